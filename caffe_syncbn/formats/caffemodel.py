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
from ..backend import to_numpy
from ..errors import CaffeError, quote
from .atomic import atomic_write
from .blobs import array_to_blob, blob_to_array, is_hdf5, length_delimited, parse_binary_file
from .file_kind import binary_kind, hdf5_kind, wrong_kind
from .hdf5 import read_dataset, reading, refuse_other_files, writing
from .mapped import MappedBlob, read_mapped_weights
from .regular import require_regular

log = logging.getLogger('caffe_syncbn')

_NET_LAYER_FIELD = caffe_pb2.NetParameter.DESCRIPTOR.fields_by_name['layer'].number

#: What a weights file holds. ``blobs``: {layer name: [MappedBlob, BlobProto, array or None]}.
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


def as_array(item):
    """A stored blob as a numpy array (BlobProtos are converted when first needed, so that
    loading never holds a second copy of every weight)."""
    if isinstance(item, MappedBlob):
        return item.values().copy()
    return blob_to_array(item) if isinstance(item, caffe_pb2.BlobProto) else np.asarray(item)


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
    require_regular(path, 'weights file')
    if is_hdf5(path):
        return _read_hdf5(path)
    error = wrong_kind(path, binary_kind(path), 'weights')
    if error is not None:
        raise error
    blobs, layers = read_mapped_weights(path)
    return StoredWeights(path, blobs, layers, False)


_MAX_BLOBS = 1024


def _read_hdf5(path):
    import h5py
    with reading(path, 'HDF5 weights file'), h5py.File(path, 'r') as f:
        refuse_other_files(f, path)
        if not isinstance(f.get('data'), h5py.Group):
            raise wrong_kind(path, hdf5_kind(f), 'weights') or \
                CaffeError("%s: no 'data' group: not a Caffe HDF5 weights file" % path)
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


def layer_proto(record):
    """What Caffe's Layer::ToProto writes: the layer's param with its blobs and phase."""
    proto = caffe_pb2.LayerParameter()
    proto.CopyFrom(record.param)
    proto.ClearField('blobs')
    if not proto.HasField('phase') and record.phase is not None:
        proto.phase = record.phase
    for array in record.arrays:
        array_to_blob(array, proto.blobs.add())
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
            f.write(length_delimited(_NET_LAYER_FIELD, layer_proto(record).SerializeToString()))


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
