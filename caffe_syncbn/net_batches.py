"""pycaffe's batched calls of a Net: ``forward_all`` and ``forward_backward_all`` take arrays
of any length and run them through the net in batches of its batch size. They use only
the Net's public face: ``forward``, ``backward``, ``blobs``, ``inputs`` and ``outputs``."""
import itertools

import numpy as np

from .backend import to_numpy
from .errors import CaffeError


def forward_all(net, blobs, inputs):
    """pycaffe's forward_all: arrays of any length, run in batches of the net's batch
    size (the last one padded with zeros); returns {output name: numpy array} with the
    padding dropped. An output without a batch axis (a loss) gives one value per batch."""
    if not inputs:
        return {name: to_numpy(value).copy() for name, value in net.forward(blobs).items()}
    collected = {}
    for batch, real in _batches(net, inputs):
        _collect(collected, net.forward(blobs, **batch), real)
    return {name: np.concatenate(parts) for name, parts in collected.items()}


def forward_backward_all(net, blobs, diffs, arrays):
    """pycaffe's forward_backward_all: input arrays (by input name) and output diffs (by
    output name) in batches; returns ({output: array}, {input: diff array})."""
    _check_lengths(arrays)
    forward = _batches(net, {k: v for k, v in arrays.items() if k in net.inputs})
    backward = _batches(net, {k: v for k, v in arrays.items() if k in net.outputs})
    outs, grads = {}, {}
    for (fb, real), (bb, real_b) in itertools.zip_longest(forward, backward, fillvalue=({}, None)):
        real = real if fb else real_b
        _collect(outs, net.forward(blobs, **fb), real)
        _collect(grads, net.backward(diffs, **bb), real)
    return ({name: np.concatenate(parts) for name, parts in outs.items()},
            {name: np.concatenate(parts) for name, parts in grads.items()})


def _batches(net, arrays):
    """Yield ({name: batch array}, number of real rows) in the net's batch size."""
    if not arrays:
        return
    count = _check_lengths(arrays)
    size = net.blobs[next(iter(arrays))].shape[0] or count
    for start in range(0, count, size):
        real = min(size, count - start)
        batch = {}
        for name, values in arrays.items():
            part = np.asarray(values[start:start + real])
            if real < size:
                part = np.concatenate([part, np.zeros((size - real,) + part.shape[1:], part.dtype)])
            batch[name] = part
        yield batch, real


def _check_lengths(arrays):
    """The common length of the arrays given to forward_all/forward_backward_all."""
    lengths = {name: len(values) for name, values in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise CaffeError('forward_all/forward_backward_all: the arrays differ in length: %s'
                         % ', '.join('%s %d' % item for item in lengths.items()))
    return next(iter(lengths.values()), 0)


def _collect(collected, arrays, real):
    """Append the first ``real`` rows of each array (host copies) to collected[name]."""
    for name, value in arrays.items():
        value = to_numpy(value)
        part = value[:real] if value.ndim else value.reshape(1)
        collected.setdefault(name, []).append(part.copy())
