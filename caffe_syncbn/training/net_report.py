"""What a solver's log reports of its nets, as Caffe writes it: the output lines of a net,
and a test net's batches and their means over its ``test_iter``."""
import logging

import numpy as np

from ..backend import to_numpy
from .input_feed import feed

log = logging.getLogger('caffe_syncbn')


def log_net_outputs(net, which, dtype, values=None):
    """Caffe's '    Train net output #k: name = v (* w = w*v loss)' lines, of ``values``
    ({output name: array}) or else the net's output blobs."""
    d = np.dtype(dtype).type
    index = 0
    for name in net.outputs:
        weight = net.output_blob_loss_weights.get(name, 0)
        data = values[name] if values is not None else to_numpy(net.blobs[name].data)
        for value in np.asarray(data, dtype).ravel():
            extra = ' (* %g = %g loss)' % (weight, d(weight) * value) if weight else ''
            log.info('    %s net output #%d: %s = %g%s', which, index, name, value, extra)
            index += 1


def test_batch(net, source, dtype):
    """One batch of a test net fed by ``source`` (or its data layers): its loss and
    {output name: host array}."""
    feed(net, source)
    loss = net.forward_prefilled()
    return loss, {name: to_numpy(net.blobs[name].data).astype(dtype) for name in net.outputs}


class TestMeans:
    """A test net's loss and outputs summed over its batches in the solver's float type,
    and their means over ``test_iter``, as Caffe's Solver::Test divides them."""

    def __init__(self, dtype, iters):
        self.d, self.iters = np.dtype(dtype).type, iters
        self.loss, self.sums = self.d(0), None

    def add(self, loss, outputs):
        self.loss += self.d(loss)
        self.sums = outputs if self.sums is None else \
            {k: self.sums[k] + v for k, v in outputs.items()}

    def mean_loss(self):
        return self.loss / self.d(max(self.iters, 1))

    def means(self):
        return {k: v / self.d(self.iters) for k, v in (self.sums or {}).items()}
