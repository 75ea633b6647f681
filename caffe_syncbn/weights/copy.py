"""Copying stored weights into a net by layer name, as Caffe's CopyTrainedLayersFrom does,
with the batch norms stored in another form converted on the way (norm_forms.py)."""
import collections
import logging

import numpy as np

from .. import caffe_pb2
from ..backend import get_array_module
from ..errors import CaffeError, name_list, naming, quote
from ..formats.blobs import blob_shape, is_legacy
from ..formats.caffemodel import as_array, read_weights
from ..formats.mapped import MappedBlob
from ..netparam.graph import shared_param_owners
from .norm_forms import fit_norm_weights, norm_units
from .save import shared_param_slots

log = logging.getLogger('caffe_syncbn')


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


def layer_blobs(net_param):
    """{layer name: [numpy arrays]} in file order; V1 blobs keep their legacy 4-D shape."""
    return arrays_of(read_weights(net_param))


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


class BlobShapeMismatch(CaffeError):
    """A stored blob whose shape is not the net's; the converters and the exporter, where
    renaming a layer is no remedy, say it in their own terms from these fields."""

    def __init__(self, source, layer_name, index, file_shape, net_shape):
        super().__init__(
            "%s: cannot copy blob %d of layer '%s': the file's blob has shape %s but the net's "
            "has shape %s (to learn this layer from scratch instead, rename it in the prototxt)"
            % (source, index, layer_name, list(file_shape), list(net_shape)))
        self.source, self.layer, self.index = source, layer_name, index
        self.file_shape, self.net_shape = list(file_shape), list(net_shape)


def _fits(item, shape):
    """Caffe's rule: a legacy (num/channels/height/width) blob fits a target shape that,
    left-padded with 1s to 4-D, is equal; any other blob must have the target shape."""
    item = item.proto if isinstance(item, MappedBlob) else item
    if isinstance(item, caffe_pb2.BlobProto):
        stored = blob_shape(item)
        if is_legacy(item):
            return len(shape) <= 4 and (1,) * (4 - len(shape)) + tuple(shape) == stored
        return stored == tuple(shape)
    return tuple(np.shape(item)) == tuple(shape)


def _stored_shape(item):
    item = item.proto if isinstance(item, MappedBlob) else item
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
            raise BlobShapeMismatch(source, name, j, _stored_shape(item), blob.shape)
        try:
            if isinstance(item, MappedBlob):         # from the file, a chunk at a time
                item.copy_into(blob.data)
            else:
                array = as_array(item)
                xp = get_array_module(blob.data)
                blob.data[...] = xp.asarray(array.reshape(blob.shape), dtype=blob.data.dtype)
        except CaffeError as exc:
            raise CaffeError("%s: layer '%s' blob %d: %s" % (source, name, j, exc)) from None
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
    stored = read_weights(source)
    with naming(stored.source):            # a damaged blob met while converting batch norms
        blobs = fit_norm_weights([layer.param for layer in net.layers], stored.blobs,
                                 stored.layers or source_layers, stored.source)
    absorbed = _absorbed_scales(net, stored.layers or source_layers)
    shared = shared_param_slots(net)
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
        return
    matched = len(with_params) - len(missing)
    if 2 * matched < len(with_params):   # more likely the file of another net than new layers
        fit = ('matches only %d of the %d layers with params of net %s by name (is it the '
               'caffemodel of another net?)')
    else:
        fit = 'has weights for %d of the %d layers with params of net %s'
    log.warning('%s ' + fit + '; the other %d keep their initial values: %s', stored.source,
                matched, len(with_params), quote(net_name), len(names), name_list(names, 600))
