"""Weights on disk: binary .caffemodel (V1 and V2 layer lists) and Caffe's HDF5 layout.

Loading takes three steps, whatever the format. ``read_weights`` gives the stored blobs by
layer name. ``convert.fit_norm_weights`` rewrites the batch norms that the file holds in
another form (BatchNorm+Scale, BN, SyncBN) into the net's form. Then the blobs are copied
into the net by layer name, with Caffe's checks. Writing takes *records*, each a layer's
LayerParameter with its arrays, so that a solver can write its weights in the terms of the
user's own prototxt. Every write is atomic (see ``atomic.py``).
"""
import collections
import logging
import os

import numpy as np

from .. import caffe_pb2
from ..backend import get_array_module, to_numpy
from ..errors import CaffeError, name_list, naming, quote
from .atomic import atomic_write
from .blobs import (array_to_blob, blob_shape, blob_to_array, is_hdf5, is_legacy,  # noqa: F401
                    length_delimited, parse_binary_file, read_blob_proto, write_blob_proto)
from .hdf5 import read_dataset, reading, writing

log = logging.getLogger('caffe_syncbn')

_NET_LAYER_FIELD = caffe_pb2.NetParameter.DESCRIPTOR.fields_by_name['layer'].number

#: What a weights file holds. ``blobs``: {layer name: [BlobProto, array or None]}.
#: ``layers``: the LayerParameters of a V2 binary file (their types and connections), else
#: None. ``partial``: True for HDF5, which stores a shared param only under its owner, so
#: that a sharing layer may lack blobs (None, or missing at the end).
StoredWeights = collections.namedtuple('StoredWeights', 'source blobs layers partial')
Record = collections.namedtuple('Record', 'param arrays phase')


# ---- reading ------------------------------------------------------------------------------
def read_net_param(path):
    """The NetParameter of a binary .caffemodel, as stored (V1 ``layers`` are not upgraded)."""
    return parse_binary_file(path, caffe_pb2.NetParameter)


def _source_layers(net_param):
    """(name, [BlobProto]) for every layer of a V2 or V1 NetParameter."""
    for layer in list(net_param.layer) + list(net_param.layers):
        yield layer.name, list(layer.blobs)


def layer_blobs(net_param):
    """{layer name: [numpy arrays]} in file order; V1 blobs keep their legacy 4-D shape."""
    return arrays_of(read_weights(net_param))


def as_array(item):
    """A stored blob as a numpy array (BlobProtos are converted when first needed, so that
    loading never holds a second copy of every weight)."""
    return blob_to_array(item) if isinstance(item, caffe_pb2.BlobProto) else np.asarray(item)


def arrays_of(stored):
    """{layer name: [numpy arrays]} of a StoredWeights whose shared params, if it is an
    HDF5 file, were filled in (``with_shared_params``)."""
    out = collections.OrderedDict()
    for name, items in stored.blobs.items():
        missing = [j for j, item in enumerate(items) if item is None]
        if missing:
            raise CaffeError("%s: layer '%s' has no blob %d; an HDF5 file stores a shared param "
                             'only under the layer that owns it, and the prototxt names no '
                             'owner for it' % (stored.source, name, missing[0]))
        try:
            out[name] = [as_array(item) for item in items]
        except CaffeError as exc:
            raise CaffeError("%s: layer '%s': %s" % (stored.source, name, exc)) from None
    return out


def shared_param_owners(layers):
    """{(layer name, blob index): (owner's name, blob index)} for the params of
    ``layers`` (LayerParameters) that share one named by an earlier layer (ParamSpec.name)."""
    owners, shared = {}, {}
    for layer in layers:
        for j, spec in enumerate(layer.param):
            if spec.name:
                owner = owners.setdefault(spec.name, (layer.name, j))
                if owner != (layer.name, j):
                    shared[(layer.name, j)] = owner
    return shared


def with_shared_params(stored, layers):
    """``stored`` with each shared param of ``layers`` under every layer that shares it: an
    HDF5 file holds it only under its owner, as Caffe writes it."""
    if not stored.partial:
        return stored
    blobs = collections.OrderedDict((name, list(items)) for name, items in stored.blobs.items())
    for (name, j), (owner, k) in shared_param_owners(layers).items():
        items, source = blobs.get(name), blobs.get(owner, [])
        if items is None:
            continue
        items.extend([None] * (j + 1 - len(items)))
        if items[j] is None and k < len(source):
            items[j] = source[k]
    return stored._replace(blobs=blobs)


def read_weights(source):
    """The StoredWeights of a .caffemodel path (V1 or V2), an HDF5 weights path (``.h5`` or
    HDF5 magic bytes), a NetParameter or a {layer name: [arrays]} dict."""
    if isinstance(source, caffe_pb2.NetParameter):
        return StoredWeights('<NetParameter %s>' % (source.name or 'unnamed'),
                             collections.OrderedDict(_source_layers(source)),
                             list(source.layer) or None, False)
    if isinstance(source, dict):
        return StoredWeights('<weights>', source, None, False)
    path = os.fspath(source)
    if not os.path.exists(path):
        raise CaffeError('weights file %s does not exist' % path)
    if is_hdf5(path):
        return _read_hdf5(path)
    net_param = read_net_param(path)
    return StoredWeights(path, collections.OrderedDict(_source_layers(net_param)),
                         list(net_param.layer) or None, False)


_MAX_BLOBS = 1024


def _read_hdf5(path):
    import h5py
    with reading(path, 'HDF5 weights file'), h5py.File(path, 'r') as f:
        if not isinstance(f.get('data'), h5py.Group):
            raise CaffeError("%s: no 'data' group: not a Caffe HDF5 weights file" % path)
        return StoredWeights(path, _hdf5_layers(f['data'], path), None, True)


def _hdf5_layers(data, path):
    """{layer name: [array or None]}: the datasets named by an index in each group.
    'conv1' is also the parent group of a layer 'conv1/bn', so every group is visited."""
    import h5py
    blobs = collections.OrderedDict()

    def visit(name, item):
        if not isinstance(item, h5py.Group):
            return
        stored = {int(k): v for k, v in item.items()
                  if isinstance(v, h5py.Dataset) and k.isascii() and k.isdigit()}
        if not stored:
            return
        where = "%s: layer %s" % (path, quote(name, 60))
        if max(stored) >= _MAX_BLOBS:
            raise CaffeError('%s has a blob numbered %d' % (where, max(stored)))
        blobs[name] = [read_dataset(stored[j], '%s blob %d' % (where, j)) if j in stored else None
                       for j in range(max(stored) + 1)]
    data.visititems(visit)
    for name in data:                 # layers without params keep their name
        blobs.setdefault(name, [])
    return blobs


# ---- copying into a net -------------------------------------------------------------------
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


def _mismatch(source, layer_name, index, file_shape, net_shape):
    return CaffeError(
        "%s: cannot copy blob %d of layer '%s': the file's blob has shape %s but the net's has "
        "shape %s (to learn this layer from scratch instead, rename it in the prototxt)"
        % (source, index, layer_name, list(file_shape), list(net_shape)))


def _fits(item, shape):
    """Caffe's rule: a legacy (num/channels/height/width) blob fits a target shape that,
    left-padded with 1s to 4-D, is equal; any other blob must have the target shape."""
    if isinstance(item, caffe_pb2.BlobProto):
        stored = blob_shape(item)
        if is_legacy(item):
            return len(shape) <= 4 and (1,) * (4 - len(shape)) + tuple(shape) == stored
        return stored == tuple(shape)
    return tuple(np.shape(item)) == tuple(shape)


def _stored_shape(item):
    return blob_shape(item) if isinstance(item, caffe_pb2.BlobProto) else np.shape(item)


def _copy_layer(stored, name, layer, items, shared):
    """Copy one layer's stored blobs into ``layer``; returns the net blobs written."""
    source = stored.source
    if len(items) > len(layer.blobs) or (not stored.partial and len(items) != len(layer.blobs)):
        raise CaffeError("%s: layer '%s' has %d blob(s) in the file but %d in the net"
                         % (source, name, len(items), len(layer.blobs)))
    written = []
    for j, blob in enumerate(layer.blobs):
        item = items[j] if j < len(items) else None
        if item is None:
            if (name, j) in shared:
                continue                   # stored under the layer that owns it
            raise CaffeError("%s: layer '%s' lacks blob %d (the net has %d)"
                             % (source, name, j, len(layer.blobs)))
        if not _fits(item, blob.shape):
            raise _mismatch(source, name, j, _stored_shape(item), blob.shape)
        try:
            array = as_array(item)
        except CaffeError as exc:
            raise CaffeError("%s: layer '%s' blob %d: %s" % (source, name, j, exc)) from None
        xp = get_array_module(blob.data)
        blob.data[...] = xp.asarray(array.reshape(blob.shape), dtype=blob.data.dtype)
        written.append(blob)
    return written


def copy_weights(net, source, source_layers=None, complete=False):
    """Copy weights into ``net`` by layer name, as Caffe's CopyTrainedLayersFrom does.

    ``source``: anything ``read_weights`` reads. Batch norms stored in another form than
    the net's (BatchNorm+Scale, BN, SyncBN) are converted on the way. ``source_layers``
    are the LayerParameters the weights were written for, where the file does not say
    (HDF5): they pair each BatchNorm with its Scale. A blob count or shape mismatch raises
    a CaffeError naming the file, layer, blob index and shapes.

    What the net and the file do not share is reported, as Caffe reports it: "Ignoring
    source layer X" (info) for each stored layer the net lacks, and a warning naming the
    net's layers with params that got nothing (a net with new layers, or a file cut
    short). Loading nothing into a net with params is an error, and so, with
    ``complete`` (a snapshot of this very net), is any layer left out.
    """
    from ..convert import fit_norm_weights
    stored = read_weights(source)
    with naming(stored.source):            # a damaged blob met while converting batch norms
        blobs = fit_norm_weights([layer.param for layer in net.layers], stored.blobs,
                                 stored.layers or source_layers, stored.source)
    absorbed = _absorbed_scales(net, stored.layers or source_layers)
    shared = _shared_params(net)
    written = set()
    for name, items in blobs.items():
        layer = net.layer_by_name.get(name)
        if layer is None:
            if name not in absorbed:
                log.info('Ignoring source layer %s', name)
            continue
        written.update(id(blob) for blob in _copy_layer(stored, name, layer, items, shared))
    _report_missing(net, stored, blobs, written, complete)


def _absorbed_scales(net, source_layers):
    """The stored Scale layers whose blobs went into one of the net's BN or SyncBN layers."""
    from ..convert import norm_units
    targets = {layer.param.name for layer in net.layers if layer.param.type in ('BN', 'SyncBN')}
    return {u.scale_name for u in norm_units(source_layers or [])
            if u.scale_name is not None and u.name in targets}


def _report_missing(net, stored, blobs, written, complete):
    """Warn about (or, if ``complete`` or nothing loaded, refuse) the net's layers with
    params that the file gave nothing."""
    with_params = [(i, name) for i, (name, layer) in enumerate(zip(net._layer_names, net.layers))
                   if layer.blobs]
    missing = [(i, name) for i, name in with_params
               if not any(id(blob) in written for blob in net.layers[i].blobs)]
    if not missing:
        return
    names = [name for _, name in missing]
    net_name = quote(net.name, 40, quotes=False)
    if not blobs:
        raise CaffeError("%s holds no layers: no weights for net '%s' (was the file cut short?)"
                         % (stored.source, net_name))
    if len(missing) == len(with_params) and all(name in net.layer_by_name for name in blobs):
        raise CaffeError("%s has no weights for net '%s': its layers (%s) have no params; "
                         "the net's layers with params are %s (was the file cut short?)"
                         % (stored.source, net_name, name_list(list(blobs), 50),
                            name_list(names, 50)))
    if len(missing) == len(with_params):
        raise CaffeError("%s: no layer of it fits net '%s': it holds %s; the net's layers "
                         'with params are %s' % (stored.source, net_name,
                                                 name_list(list(blobs), 50), name_list(names, 50)))
    if complete:
        raise CaffeError("%s lacks %d layer(s) with params of net '%s': %s"
                         % (stored.source, len(names), net_name, name_list(names, 80)))
    last = next(reversed(blobs), None)
    ends_at = net._layer_names.index(last) if last in net.layer_by_name else None
    if ends_at is not None and missing[0][0] > ends_at:
        log.warning('%s ends at layer %s: the %d layer(s) with params after it got no '
                    'weights and keep their initial values (was the file cut short?): %s',
                    stored.source, quote(last), len(names), name_list(names, 600))
    else:
        log.warning('%s has no weights for %d layer(s) with params, which keep their initial '
                    'values: %s', stored.source, len(names), name_list(names, 600))


# ---- writing ------------------------------------------------------------------------------
def net_records(net):
    """The Records of ``net``: every layer's LayerParameter, param arrays and phase."""
    return [Record(layer.param, [blob.data for blob in layer.blobs], getattr(layer, 'phase', None))
            for layer in net.layers]


def _layer_proto(record):
    """What Caffe's Layer::ToProto writes: the layer's param with its blobs and phase."""
    proto = caffe_pb2.LayerParameter()
    proto.CopyFrom(record.param)
    proto.ClearField('blobs')
    if not proto.HasField('phase') and record.phase is not None:
        proto.phase = record.phase
    for array in record.arrays:
        array_to_blob(array, proto.blobs.add())
    return proto


def net_to_proto(net):
    """The NetParameter that ``write_caffemodel`` writes (the net's name and every layer)."""
    proto = caffe_pb2.NetParameter()
    if getattr(net, 'name', ''):
        proto.name = net.name
    for record in net_records(net):
        proto.layer.add().CopyFrom(_layer_proto(record))
    return proto


def write_records(path, records, name=''):
    """Write Records as a binary NetParameter, as Caffe's Net.save() does.

    Layers are serialized one at a time (a NetParameter is the concatenation of its
    fields), so no second copy of all the weights is ever held in memory.
    """
    with atomic_write(path) as f:
        if name:
            f.write(caffe_pb2.NetParameter(name=name).SerializeToString())
        for record in records:
            f.write(length_delimited(_NET_LAYER_FIELD, _layer_proto(record).SerializeToString()))


def write_records_hdf5(path, records, shared=()):
    """Write Records in Caffe's HDF5 layout: datasets ``data/<layer>/<i>``.

    Every layer gets a group (empty when it has no params); the params in ``shared``
    ((layer name, index) pairs) are stored only under the layer that owns them, as Caffe's
    Net.save_hdf5() does.
    """
    with writing(path) as f:
        data = f.create_group('data')
        for record in records:
            layer_name = record.param.name
            group = data.require_group(layer_name)   # 'a' may exist as the parent of 'a/b'
            for j, array in enumerate(record.arrays):
                if (layer_name, j) not in shared:
                    group.create_dataset(str(j), data=to_numpy(array))


def write_caffemodel(net, path):
    """Write ``net``'s weights as a binary NetParameter (Caffe's Net.save())."""
    write_records(path, net_records(net), getattr(net, 'name', ''))


def write_hdf5(net, path):
    """Write ``net``'s weights in Caffe's HDF5 layout (Caffe's Net.save_hdf5())."""
    write_records_hdf5(path, net_records(net), _shared_params(net))
