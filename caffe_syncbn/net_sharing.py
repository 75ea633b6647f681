"""Nets that share weights: pycaffe's ``share_with`` (Caffe's ShareTrainedLayersWith) and
the solver's test nets, which use the train net's param Blobs. They use only pycaffe's
names of a Net: ``layers``, ``_layer_names``, ``layer_by_name``, ``params``, ``name``."""
from .errors import CaffeError


def share_trained_layers(net, other):
    """Caffe's ShareTrainedLayersWith: every layer of ``net`` named as one of ``other``'s
    uses that layer's param data (not diffs), which must match in number and shape."""
    for name, source in zip(other._layer_names, other.layers):
        target = net.layer_by_name.get(name)
        if target is None:
            continue
        if len(target.blobs) != len(source.blobs):
            raise CaffeError("share_with: layer '%s' has %d param blobs here but %d in net '%s'"
                             % (name, len(target.blobs), len(source.blobs), other.name))
        for j, (mine, theirs) in enumerate(zip(target.blobs, source.blobs)):
            if mine.shape != theirs.shape:
                raise CaffeError("share_with: layer '%s' param %d has shape %s here but %s in "
                                 "net '%s'" % (name, j, mine.shape, theirs.shape, other.name))
            mine.share_data(theirs)


def take_params(net, other):
    """Make ``net``'s layers hold ``other``'s param Blobs, by layer name, where the shapes
    match (test nets); the Net then lists its params again."""
    for name, layer in zip(net._layer_names, net.layers):
        source = other.layer_by_name.get(name)
        if source is None or not layer.blobs:
            continue
        for j, blob in enumerate(layer.blobs):
            if j < len(source.blobs) and source.blobs[j].shape == blob.shape:
                layer.blobs[j] = source.blobs[j]


def holds_only_params_of(net, other):
    """Whether every param of ``net`` is one of ``other``'s Blobs."""
    shared = {id(blob) for blobs in other.params.values() for blob in blobs}
    return all(id(blob) in shared for blobs in net.params.values() for blob in blobs)
