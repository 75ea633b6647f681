"""Scale and Bias: multiply or add a blob broadcast over the axes around it.

The operand (a learned blob, or the second bottom) covers the bottom's axes
[axis, axis + operand axes); an operand with no axes is a scalar.
"""
import numpy as np

from ... import caffe_pb2
from ...backend.cpu_threads import blocks
from ...layer import Layer, register
from ..shape.layers import canonical_axis


def learned_operand_shape(layer, x, axis, num_axes):
    """The shape of a learned operand: bottom axes [axis, axis + num_axes), -1 = to the end."""
    start = canonical_axis(layer, x, axis)
    if num_axes < -1:
        raise layer.error('num_axes must be >= -1, got %d' % num_axes)
    end = x.num_axes if num_axes == -1 else start + num_axes
    if end > x.num_axes:
        raise layer.error('axis %d + num_axes %d exceed the %d axes of bottom shape %s'
                          % (start, num_axes, x.num_axes, x.shape))
    return x.shape[start:end]


def broadcast_dims(layer, x, operand_shape, axis):
    """(outer, operand count, inner) for viewing ``x`` around the operand."""
    start = 0 if len(operand_shape) == 0 else canonical_axis(layer, x, axis)
    end = start + len(operand_shape)
    if x.shape[start:end] != tuple(operand_shape):
        raise layer.error('operand shape %s does not match bottom shape %s from axis %d'
                          % (tuple(operand_shape), x.shape, start))
    return x.count_range(0, start), x.count_range(start, end), x.count_range(end)


def operand_sum(row_sums, outer, operand):
    """Per-row sums over (outer * dim) rows added up to the operand's shape and dtype."""
    return row_sums.reshape(outer, -1).sum(axis=0).reshape(operand.shape).astype(operand.dtype)


@register('Scale')
class ScaleLayer(Layer):
    """top = x * scale (+ bias). One bottom: the scale is learned (blob 0, filler
    default 1). Two bottoms: bottom 1 is the scale. The bias, with bias_term, is
    the last blob (filler default 0)."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=1, maximum=2)
        self.check_tops(top, exact=1)
        p = self.param.scale_param
        x = bottom[0]
        if len(bottom) == 1:
            filler = p.filler if p.HasField('filler') else \
                caffe_pb2.FillerParameter(type='constant', value=1)
            shape = learned_operand_shape(self, x, p.axis, p.num_axes)
            self.blobs.append(self.make_blob(shape, filler))
        self.bias_index = None
        if p.bias_term:
            bias_axes = bottom[1].num_axes if len(bottom) > 1 else p.num_axes
            shape = learned_operand_shape(self, x, p.axis, bias_axes)
            self.bias_index = len(self.blobs)
            self.blobs.append(self.make_blob(shape, p.bias_filler))

    def _scale_blob(self, bottom):
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def reshape(self, bottom, top):
        x = bottom[0]
        scale = self._scale_blob(bottom)
        # the net reshapes before every forward: the checks run when a shape changes
        shapes = (x.shape, scale.shape,
                  self.blobs[self.bias_index].shape if self.bias_index is not None else None)
        if shapes != getattr(self, '_checked_shapes', None):
            self.dims = broadcast_dims(self, x, scale.shape, self.param.scale_param.axis)
            if self.bias_index is not None and shapes[2] != scale.shape:
                raise self.error('bias shape %s differs from scale shape %s'
                                 % (shapes[2], scale.shape))
            self._checked_shapes = shapes
        if top[0] is not x:
            top[0].reshape(x.shape)

    def forward(self, bottom, top):
        outer, dim, inner = self.dims
        learned = len(bottom) == 1
        x = bottom[0].data.reshape(outer * dim, inner)
        y = top[0].data.reshape(outer * dim, inner)
        # in place, the input is overwritten but the scale gradient needs it
        keep = top[0] is bottom[0] and self.backward_runs and \
            (not learned or self.wants_param_gradient(0))
        saved = self._saved_buffer(x) if keep else None
        scale = self._per_row(self._scale_blob(bottom).data)
        bias = self._per_row(self.blobs[self.bias_index].data) \
            if self.bias_index is not None else None

        def work(r0, r1):
            if saved is not None:
                saved[r0:r1] = x[r0:r1]
            self.xp.multiply(x[r0:r1], scale[r0:r1], out=y[r0:r1])
            if bias is not None:
                y[r0:r1] += bias[r0:r1]
        blocks(self.xp, outer * dim, inner, work)
        self._saved_input = saved

    def _per_row(self, operand):
        """The operand (dim values) repeated for each of the ``outer`` slices, as a column."""
        outer = self.dims[0]
        column = operand.reshape(-1, 1)
        if column.dtype != self.dtype:
            column = column.astype(self.dtype)
        return column if outer == 1 else self.xp.tile(column, (outer, 1))

    def _saved_buffer(self, x):
        """The array the input is copied into, kept from one forward to the next."""
        buffer = getattr(self, '_input_copy', None)
        if buffer is None or buffer.shape != x.shape or buffer.dtype != x.dtype:
            buffer = self._input_copy = self.xp.empty_like(x)
        return buffer

    def backward_reads(self, bottom, top):
        return list(bottom)         # the input (or its copy, in place) and the operand

    def backward(self, top, propagate_down, bottom):
        xp = self.xp
        scale = self._scale_blob(bottom)
        outer, dim, inner = self.dims
        rows = outer * dim
        dy = top[0].diff.reshape(rows, inner)
        learned = len(bottom) == 1
        bias_grad = self.bias_index is not None and self.wants_param_gradient(self.bias_index)
        scale_grad = (learned and self.wants_param_gradient(0)) or \
            (not learned and propagate_down[1])
        x = (self._saved_input if self._saved_input is not None
             else bottom[0].data.reshape(rows, inner))
        dx = bottom[0].diff.reshape(rows, inner) if propagate_down[0] else None
        per_row = self._per_row(scale.data) if dx is not None else None
        sum_dy = xp.empty(rows, np.float64) if bias_grad else None
        sum_dy_x = xp.empty(rows, np.float64) if scale_grad else None
        # half blobs (mixed precision) sum in float32: numpy's einsum takes no bfloat16,
        # and its float16 einsum adds in float16
        sums_in = np.promote_types(dy.dtype, np.float32)

        # each block's top diff is read before bottom 0's diff is written: in place they
        # are one array
        def work(r0, r1):
            block = dy[r0:r1]
            if sum_dy is not None:
                sum_dy[r0:r1] = block.sum(axis=1, dtype=sums_in)
            if sum_dy_x is not None:
                sum_dy_x[r0:r1] = xp.einsum('ij,ij->i', block, x[r0:r1], dtype=sums_in)
            if dx is not None:
                xp.multiply(block, per_row[r0:r1], out=dx[r0:r1])
        blocks(xp, rows, inner, work)
        if bias_grad:
            bias = self.blobs[self.bias_index]
            bias.diff += operand_sum(sum_dy, outer, bias)
        if scale_grad:
            if learned:
                scale.diff += operand_sum(sum_dy_x, outer, scale)
            else:
                scale.diff[...] = operand_sum(sum_dy_x, outer, scale)


@register('Bias')
class BiasLayer(Layer):
    """top = x + bias: a learned blob (one bottom, filler default 0) or bottom 1."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=1, maximum=2)
        self.check_tops(top, exact=1)
        if len(bottom) == 1:
            p = self.param.bias_param
            shape = learned_operand_shape(self, bottom[0], p.axis, p.num_axes)
            self.blobs.append(self.make_blob(shape, p.filler))

    def _bias_blob(self, bottom):
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def reshape(self, bottom, top):
        x = bottom[0]
        self.dims = broadcast_dims(self, x, self._bias_blob(bottom).shape,
                                   self.param.bias_param.axis)
        if top[0] is not x:
            top[0].reshape(x.shape)

    def forward(self, bottom, top):
        outer, dim, inner = self.dims
        x = bottom[0].data
        y = x.reshape(outer, dim, inner) + self._bias_blob(bottom).data.reshape(1, dim, 1)
        top[0].data[...] = y.reshape(x.shape)

    def backward(self, top, propagate_down, bottom):
        bias = self._bias_blob(bottom)
        outer, dim, inner = self.dims
        row_sums = top[0].diff.reshape(outer * dim, inner).sum(axis=1)
        if len(bottom) == 1:
            if self.wants_param_gradient(0):
                bias.diff += operand_sum(row_sums, outer, bias)
        elif propagate_down[1]:
            bias.diff[...] = operand_sum(row_sums, outer, bias)
        if propagate_down[0] and bottom[0] is not top[0]:
            bottom[0].diff[...] = top[0].diff
