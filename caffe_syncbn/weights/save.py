"""A net's weights written as Caffe writes them (Net.save, Net.save_hdf5, Net.to_proto)."""
from .. import caffe_pb2
from ..formats.caffemodel import Record, layer_proto, write_records, write_records_hdf5


# ---- copying into a net -------------------------------------------------------------------
def shared_param_slots(net):
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


# ---- writing ------------------------------------------------------------------------------
def net_records(net):
    """The Records of ``net``: every layer's LayerParameter, param arrays and phase."""
    return [Record(layer.param, [blob.data for blob in layer.blobs], getattr(layer, 'phase', None))
            for layer in net.layers]


def net_to_proto(net):
    """The NetParameter that ``write_caffemodel`` writes (the net's name and every layer)."""
    proto = caffe_pb2.NetParameter()
    if getattr(net, 'name', ''):
        proto.name = net.name
    for record in net_records(net):
        proto.layer.add().CopyFrom(layer_proto(record))
    return proto


def write_caffemodel(net, path):
    """Write ``net``'s weights as a binary NetParameter (Caffe's Net.save())."""
    write_records(path, net_records(net), getattr(net, 'name', ''))


def write_hdf5(net, path):
    """Write ``net``'s weights in Caffe's HDF5 layout (Caffe's Net.save_hdf5())."""
    write_records_hdf5(path, net_records(net), shared_param_slots(net))
