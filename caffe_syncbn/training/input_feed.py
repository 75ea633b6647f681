"""Input blobs fed from Python: what ``solver.set_data_source``'s sources give."""
from ..errors import CaffeError


def feed(net, source):
    """Put what ``source()`` gives ({blob name: array}) into ``net``'s blobs, reshaping
    them to fit; nothing when ``source`` is None."""
    if source is None:
        return
    for name, value in source().items():
        if name not in net.blobs:
            raise CaffeError("data source gave blob '%s', which net '%s' does not have"
                             % (name, net.name))
        blob = net.blobs[name]
        value = blob.xp.asarray(value, dtype=blob.dtype)
        if blob.shape != value.shape:
            blob.reshape(value.shape)
        blob.data[...] = value
