"""InnerProduct (fully connected) and Embed (a learned lookup table)."""
import math

import numpy as np

from ...backend.cpu_threads import matmul
from ...layer import Layer, register
from ..pooling.array import scatter_add
from ..shape.layers import canonical_axis


@register('InnerProduct')
class InnerProductLayer(Layer):
    """``y = x W^T + b`` with x flattened from ``axis`` on; ``transpose`` stores W as (K, N)."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        ip = self.param.inner_product_param
        self.num_output = ip.num_output
        if self.num_output < 1:
            raise self.error('num_output must be positive, got %d' % self.num_output)
        self.axis = canonical_axis(self, bottom[0], ip.axis)
        self.inputs = bottom[0].count_range(self.axis)
        if self.inputs == 0:
            raise self.error('no inputs per sample: axes %d.. of the bottom, shape %s, hold '
                             '0 values' % (self.axis, bottom[0].shape))
        self.transpose = ip.transpose
        shape = (self.num_output, self.inputs)
        self.blobs = [self.make_blob(shape[::-1] if self.transpose else shape, ip.weight_filler)]
        self.bias_term = ip.bias_term
        if self.bias_term:
            self.blobs.append(self.make_blob((self.num_output,), ip.bias_filler))

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if math.prod(shape[self.axis:]) != self.inputs:
            raise self.error('expected %d inputs per sample (axes %d.. of the bottom), got shape %s'
                             % (self.inputs, self.axis, shape))
        top[0].reshape(shape[:self.axis] + (self.num_output,))

    def _weight_nk(self):
        """The weights as an (outputs, inputs) matrix, a view for either storage order."""
        w = self.blobs[0].data
        if self.transpose:
            return w.reshape(self.inputs, self.num_output).T
        return w.reshape(self.num_output, self.inputs)

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(-1, self.inputs)
        y = top[0].data.reshape(-1, self.num_output)
        matmul(x, self._weight_nk().T, out=y)
        if self.bias_term:
            y += self.blobs[1].data

    def backward_reads(self, bottom, top):
        return list(bottom)         # the weight gradient reads the input

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.reshape(-1, self.num_output)
        x = bottom[0].data.reshape(-1, self.inputs)
        if self.wants_param_gradient(0):
            if self.transpose:
                grad = self.blobs[0].diff.reshape(self.inputs, self.num_output)
                matmul(x.T, dy, out=grad, accumulate=True)
            else:
                grad = self.blobs[0].diff.reshape(self.num_output, self.inputs)
                matmul(dy.T, x, out=grad, accumulate=True)
        if self.bias_term and self.wants_param_gradient(1):
            self.blobs[1].diff += dy.sum(axis=0)
        if propagate_down[0]:
            matmul(dy, self._weight_nk(), out=bottom[0].diff.reshape(-1, self.inputs))


@register('Embed')
class EmbedLayer(Layer):
    """Row ``x`` of an (input_dim, num_output) table (+ bias) for each integer index x."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        ep = self.param.embed_param
        self.num_output, self.input_dim = ep.num_output, ep.input_dim
        if self.num_output < 1 or self.input_dim < 1:
            raise self.error('num_output and input_dim must be positive, got %d and %d'
                             % (self.num_output, self.input_dim))
        self.blobs = [self.make_blob((self.input_dim, self.num_output), ep.weight_filler)]
        self.bias_term = ep.bias_term
        if self.bias_term:
            self.blobs.append(self.make_blob((self.num_output,), ep.bias_filler))

    def allow_force_backward(self, bottom_index):
        return False

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape + (self.num_output,))

    def _indices(self, values):
        xp = self.xp
        index = values.astype(np.int64).ravel()
        if bool(xp.any(index != values.ravel())):
            raise self.error('indices must be integers')
        if index.size and (int(index.min()) < 0 or int(index.max()) >= self.input_dim):
            raise self.error('indices must lie in [0, %d), got values from %d to %d'
                             % (self.input_dim, int(index.min()), int(index.max())))
        return index

    def forward(self, bottom, top):
        rows = self.blobs[0].data[self._indices(bottom[0].data)]
        if self.bias_term:
            rows = rows + self.blobs[1].data
        top[0].data[...] = rows.reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            raise self.error('cannot backpropagate to the indices (bottom 0)')
        dy = top[0].diff.reshape(-1, self.num_output)
        if self.wants_param_gradient(0):
            scatter_add(self.blobs[0].diff, self._indices(bottom[0].data), dy)
        if self.bias_term and self.wants_param_gradient(1):
            self.blobs[1].diff += dy.sum(axis=0)
