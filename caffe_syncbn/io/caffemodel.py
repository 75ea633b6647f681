"""Weights on disk: binary .caffemodel (V1 and V2 layer lists), Caffe's HDF5 layout, .binaryproto.

Reading never goes through a size-limited protobuf stream: the file is memory-mapped and
parsed in one call, so VGG-sized (500+ MB) models load. Blob payloads are converted to and
from numpy in bulk (raw little-endian bytes), never element by element.
Every write is atomic (see ``atomic.py``).
"""
import collections
import logging
import mmap
import os

import numpy as np
from google.protobuf.message import DecodeError

from .. import caffe_pb2
from ..backend import get_array_module, to_numpy
from ..errors import CaffeError
from .atomic import atomic_write

log = logging.getLogger('caffe_syncbn')

HDF5_MAGIC = b'\x89HDF\r\n\x1a\n'
_NET_LAYER_FIELD = caffe_pb2.NetParameter.DESCRIPTOR.fields_by_name['layer'].number
_BLOB_DATA_FIELD = caffe_pb2.BlobProto.DESCRIPTOR.fields_by_name['data'].number
_BLOB_DOUBLE_FIELD = caffe_pb2.BlobProto.DESCRIPTOR.fields_by_name['double_data'].number


# ---- blobs ------------------------------------------------------------------------------
def _is_legacy(proto):
    return any(proto.HasField(f) for f in ('num', 'channels', 'height', 'width'))


def blob_shape(proto):
    """The shape a BlobProto describes: ``shape`` or the legacy 4-D num/channels/height/width."""
    if _is_legacy(proto):
        return (proto.num, proto.channels, proto.height, proto.width)
    return tuple(int(d) for d in proto.shape.dim)


def blob_to_array(proto, diff=False):
    """A numpy array (float32, or float64 for ``double_data``) holding a BlobProto's data.

    Legacy blobs keep their 4-D num/channels/height/width shape, as in pycaffe.
    """
    shape = blob_shape(proto)
    singles, doubles = (proto.diff, proto.double_diff) if diff else (proto.data, proto.double_data)
    values = np.array(doubles, np.float64) if len(doubles) else np.array(singles, np.float32)
    count = int(np.prod(shape, dtype=np.int64))
    if values.size != count:
        raise CaffeError('blob of shape %s holds %d values, expected %d'
                         % (list(shape), values.size, count))
    return values.reshape(shape)


def _varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length_delimited(field, payload):
    """Wire bytes of field ``field`` holding ``payload`` (packed numbers or a sub-message)."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def array_to_blob(array, proto=None):
    """A BlobProto (modern ``shape`` form) holding ``array``: float64 as ``double_data``,
    anything else as float32 ``data``. Fills ``proto`` when given."""
    array = to_numpy(array)
    proto = caffe_pb2.BlobProto() if proto is None else proto
    proto.Clear()
    if array.ndim:      # Caffe leaves `shape` unset for a 0-d blob
        proto.shape.dim.extend(array.shape)
    if array.dtype == np.float64:
        field, raw = _BLOB_DOUBLE_FIELD, array.astype('<f8').tobytes()
    else:
        field, raw = _BLOB_DATA_FIELD, array.astype('<f4').tobytes()
    if raw:
        # Parsing the packed bytes is a bulk copy; extend() would box every value.
        proto.MergeFromString(_length_delimited(field, raw))
    return proto


def read_blob_proto(path):
    """The array stored in a .binaryproto BlobProto file (mean file, infogain matrix)."""
    proto = _parse_file(path, caffe_pb2.BlobProto)
    try:
        return blob_to_array(proto)
    except CaffeError as exc:
        raise CaffeError('%s: %s' % (path, exc)) from None


def write_blob_proto(path, array):
    with atomic_write(path) as f:
        f.write(array_to_blob(array).SerializeToString())


# ---- nets -------------------------------------------------------------------------------
def is_hdf5(path):
    path = os.fspath(path)
    if path.endswith('.h5'):
        return True
    try:
        with open(path, 'rb') as f:
            return f.read(len(HDF5_MAGIC)) == HDF5_MAGIC
    except OSError:
        return False


def _parse_file(path, message_class):
    path = os.fspath(path)
    what = message_class.DESCRIPTOR.name
    try:
        with open(path, 'rb') as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise CaffeError('%s: the file is empty, not a binary %s' % (path, what))
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                if mapped[:len(HDF5_MAGIC)] == HDF5_MAGIC:
                    raise CaffeError('%s is an HDF5 file, not a binary %s' % (path, what))
                with memoryview(mapped) as view:
                    return message_class.FromString(view)
    except OSError as exc:
        raise CaffeError('cannot read %s: %s' % (path, exc.strerror or exc)) from None
    except DecodeError:
        raise CaffeError('%s is not a valid binary %s: the file is truncated or corrupt'
                         % (path, what)) from None


def read_net_param(path):
    """The NetParameter of a binary .caffemodel, as stored (V1 ``layers`` are not upgraded)."""
    return _parse_file(path, caffe_pb2.NetParameter)


def _source_layers(net_param):
    """(name, [BlobProto]) for every layer of a V2 or V1 NetParameter."""
    for layer in list(net_param.layer) + list(net_param.layers):
        yield layer.name, list(layer.blobs)


def layer_blobs(net_param):
    """{layer name: [numpy arrays]} in file order; V1 blobs keep their legacy 4-D shape."""
    out = collections.OrderedDict()
    for name, protos in _source_layers(net_param):
        try:
            out[name] = [blob_to_array(p) for p in protos]
        except CaffeError as exc:
            raise CaffeError("layer '%s': %s" % (name, exc)) from None
    return out


def _legacy_fits(proto, shape):
    """Caffe's rule for legacy blobs: the target shape, left-padded with 1s to 4-D, is equal."""
    return len(shape) <= 4 and (1,) * (4 - len(shape)) + tuple(shape) == blob_shape(proto)


def _assign(blob, array):
    xp = get_array_module(blob.data)
    blob.data[...] = xp.asarray(array.reshape(blob.shape), dtype=blob.data.dtype)


def _mismatch(source, layer_name, index, file_shape, net_shape):
    return CaffeError(
        "%s: cannot copy blob %d of layer '%s': the file's blob has shape %s but the net's has "
        "shape %s (to learn this layer from scratch instead, rename it in the prototxt)"
        % (source, index, layer_name, list(file_shape), list(net_shape)))


def _copy_from_proto(net, net_param, source):
    for name, protos in _source_layers(net_param):
        layer = net.layer_by_name.get(name)
        if layer is None:
            log.debug("%s: ignoring layer '%s', which the net lacks", source, name)
            continue
        if len(protos) != len(layer.blobs):
            raise CaffeError("%s: layer '%s' has %d blob(s) in the file but %d in the net"
                             % (source, name, len(protos), len(layer.blobs)))
        for j, (proto, blob) in enumerate(zip(protos, layer.blobs)):
            fits = _legacy_fits(proto, blob.shape) if _is_legacy(proto) else \
                blob_shape(proto) == tuple(blob.shape)
            if not fits:
                raise _mismatch(source, name, j, blob_shape(proto), blob.shape)
            try:
                _assign(blob, blob_to_array(proto))
            except CaffeError as exc:
                raise CaffeError("%s: layer '%s' blob %d: %s" % (source, name, j, exc)) from None


def _shared_params(net):
    """(layer name, blob index) of the param blobs that repeat one owned by an earlier layer.

    Caffe's HDF5 files store only owners. The Net lists owners in ``learnable_params``;
    without it, a blob object seen in an earlier layer counts as shared.
    """
    owners = getattr(net, 'learnable_params', None)
    owner_ids = {id(b) for b in owners} if owners is not None else None
    shared, seen = set(), set()
    for name, layer in zip(net._layer_names, net.layers):
        for j, blob in enumerate(layer.blobs):
            if id(blob) in seen or (owner_ids is not None and id(blob) not in owner_ids):
                shared.add((name, j))
            seen.add(id(blob))
    return shared


def _copy_from_hdf5(net, path):
    import h5py
    shared = _shared_params(net)
    try:
        with h5py.File(path, 'r') as f:
            if 'data' not in f:
                raise CaffeError("%s: no 'data' group: not a Caffe HDF5 weights file" % path)
            data = f['data']
            for name, layer in zip(net._layer_names, net.layers):
                if name not in data:
                    continue
                group = data[name]
                # Only datasets count: 'conv1' is also the parent group of a layer 'conv1/bn'.
                stored = sum(isinstance(item, h5py.Dataset) for item in group.values())
                if stored > len(layer.blobs):
                    raise CaffeError("%s: layer '%s' has %d blob(s) in the file but %d in the net"
                                     % (path, name, stored, len(layer.blobs)))
                for j, blob in enumerate(layer.blobs):
                    if str(j) not in group:
                        if (name, j) in shared:
                            continue
                        raise CaffeError("%s: layer '%s' lacks blob %d (the net has %d)"
                                         % (path, name, j, len(layer.blobs)))
                    dataset = group[str(j)]
                    if tuple(dataset.shape) != tuple(blob.shape):
                        raise _mismatch(path, name, j, dataset.shape, blob.shape)
                    _assign(blob, dataset[()])
    except OSError as exc:
        raise CaffeError('cannot read HDF5 weights %s: %s' % (path, exc)) from None


def copy_weights(net, source):
    """Copy weights into ``net`` by layer name, as Caffe's CopyTrainedLayersFrom does.

    ``source``: a .caffemodel path (V1 or V2), an HDF5 weights path (``.h5`` or HDF5
    magic bytes) or a NetParameter. Layers the net lacks are skipped; a blob count or
    shape mismatch raises a CaffeError naming the file, layer, blob index and shapes.
    """
    if isinstance(source, caffe_pb2.NetParameter):
        _copy_from_proto(net, source, '<NetParameter %s>' % (source.name or 'unnamed'))
        return
    source = os.fspath(source)
    if not os.path.exists(source):
        raise CaffeError('weights file %s does not exist' % source)
    if is_hdf5(source):
        _copy_from_hdf5(net, source)
    else:
        _copy_from_proto(net, read_net_param(source), source)


def _layer_proto(layer):
    """What Caffe's Layer::ToProto writes: the layer's param with its blobs and phase."""
    proto = caffe_pb2.LayerParameter()
    proto.CopyFrom(layer.param)
    proto.ClearField('blobs')
    if not proto.HasField('phase') and hasattr(layer, 'phase'):
        proto.phase = layer.phase
    for blob in layer.blobs:
        array_to_blob(blob.data, proto.blobs.add())
    return proto


def net_to_proto(net):
    """The NetParameter that ``write_caffemodel`` writes (the net's name and every layer)."""
    proto = caffe_pb2.NetParameter()
    if getattr(net, 'name', ''):
        proto.name = net.name
    for layer in net.layers:
        proto.layer.add().CopyFrom(_layer_proto(layer))
    return proto


def write_caffemodel(net, path):
    """Write ``net``'s weights as a binary NetParameter, as Caffe's Net.save() does.

    Layers are serialized one at a time (a NetParameter is the concatenation of its
    fields), so no second copy of all the weights is ever held in memory.
    """
    with atomic_write(path) as f:
        if getattr(net, 'name', ''):
            f.write(caffe_pb2.NetParameter(name=net.name).SerializeToString())
        for layer in net.layers:
            f.write(_length_delimited(_NET_LAYER_FIELD, _layer_proto(layer).SerializeToString()))


def write_hdf5(net, path):
    """Write ``net``'s weights in Caffe's HDF5 layout: datasets ``data/<layer>/<i>``.

    Every layer gets a group (empty when it has no params); a shared param is stored
    only under the layer that owns it, as Caffe's Net.save_hdf5() does.
    """
    import h5py
    shared = _shared_params(net)
    with atomic_write(path, as_path=True) as tmp:
        with h5py.File(tmp, 'w') as f:
            data = f.create_group('data')
            for name, layer in zip(net._layer_names, net.layers):
                group = data.require_group(name)   # 'a' may exist as the parent of 'a/b'
                for j, blob in enumerate(layer.blobs):
                    if (name, j) not in shared:
                        group.create_dataset(str(j), data=to_numpy(blob.data))
