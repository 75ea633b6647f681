"""ArgMax and Reduction: layers that reduce over axes of their bottom."""
import numpy as np

from ... import caffe_pb2
from ...layer import Layer, register
from ..shape.layers import canonical_axis


@register('ArgMax')
class ArgMaxLayer(Layer):
    """Indices (or values) of the top_k largest entries; ties go to the larger index.

    Without ``axis`` each item (axis 0) is flattened; the top is (N, 1 or 2, top_k)
    padded with 1s to the bottom's axes: the indices, then the values if out_max_val.
    With ``axis`` the top is the bottom with that axis of size top_k, holding the
    values if out_max_val, else the indices."""

    def full_precision_top(self, index):
        return True           # indices, exact to 2^24 in float32

    def reshape(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        p = self.param.argmax_param
        x = bottom[0]
        self.top_k = p.top_k
        if p.HasField('axis'):
            self.axis = canonical_axis(self, x, p.axis)
            length = x.shape[self.axis]
            shape = list(x.shape)
            shape[self.axis] = self.top_k
        else:
            self.axis = None
            length = x.count_range(1)
            shape = [1] * max(x.num_axes, 3)
            shape[0], shape[1], shape[2] = x.shape[0], 2 if p.out_max_val else 1, self.top_k
        if not 1 <= self.top_k <= length:
            raise self.error('top_k %d must be in [1, %d] for bottom shape %s'
                             % (self.top_k, length, x.shape))
        top[0].reshape(shape)

    def forward(self, bottom, top):
        xp = self.xp
        x = bottom[0].data
        if self.axis is None:
            scores = x.reshape(x.shape[0], int(np.prod(x.shape[1:])))
        else:
            scores = xp.moveaxis(x, self.axis, -1)
        # A stable sort of the reversed scores, descending, puts the larger index first on ties.
        length = scores.shape[-1]
        stable = {'kind': 'stable'} if xp is np else {}   # CuPy always sorts stably
        order = xp.argsort(-scores[..., ::-1], axis=-1, **stable)[..., :self.top_k]
        indices = (length - 1) - order
        values = xp.take_along_axis(scores, indices, axis=-1)
        out_max_val = self.param.argmax_param.out_max_val
        if self.axis is None:
            out = top[0].data.reshape(x.shape[0], 2 if out_max_val else 1, self.top_k)
            out[:, 0] = indices
            if out_max_val:
                out[:, 1] = values
        else:
            result = values if out_max_val else indices
            top[0].data[...] = xp.moveaxis(result, -1, self.axis)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            raise self.error('ArgMax has no gradient (Caffe does not implement its backward)')


@register('Reduction')
class ReductionLayer(Layer):
    """SUM, ASUM, SUMSQ or MEAN over the axes from ``axis`` on, times ``coeff``."""

    OPS = caffe_pb2.ReductionParameter

    def reshape(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        x = bottom[0]
        self.axis = canonical_axis(self, x, self.param.reduction_param.axis)
        self.inner = x.count_range(self.axis)
        if self.inner == 0:
            raise self.error('axes %d.. of the bottom, shape %s, hold no values to reduce'
                             % (self.axis, x.shape))
        top[0].reshape(x.shape[:self.axis])

    def forward(self, bottom, top):
        p = self.param.reduction_param
        xp = self.xp
        x = bottom[0].data.reshape(-1, self.inner)
        op = p.operation
        if op == self.OPS.ASUM:
            x = xp.abs(x)
        elif op == self.OPS.SUMSQ:
            x = x * x
        coeff = p.coeff / self.inner if op == self.OPS.MEAN else p.coeff
        top[0].data[...] = (x.sum(axis=1) * coeff).reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        p = self.param.reduction_param
        xp = self.xp
        op = p.operation
        coeff = p.coeff / self.inner if op == self.OPS.MEAN else p.coeff
        dy = (top[0].diff.reshape(-1, 1) * coeff)
        x = bottom[0].data.reshape(-1, self.inner)
        if op == self.OPS.ASUM:
            dx = xp.sign(x) * dy
        elif op == self.OPS.SUMSQ:
            dx = (2 * x) * dy
        else:
            dx = xp.broadcast_to(dy, x.shape)
        bottom[0].diff[...] = dx.reshape(bottom[0].shape)
