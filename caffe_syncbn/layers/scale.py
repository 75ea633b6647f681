"""Scale and Bias: multiply or add a blob broadcast over the axes around it.

The operand (a learned blob, or the second bottom) covers the bottom's axes
[axis, axis + operand axes); an operand with no axes is a scalar.
"""
from .. import caffe_pb2
from ..layer import Layer, register
from .shape import canonical_axis


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


def operand_sum(dy3, shape):
    """Sum a (outer, dim, inner) array to the operand's shape."""
    return dy3.sum(axis=(0, 2)).reshape(shape)


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
        self.dims = broadcast_dims(self, x, scale.shape, self.param.scale_param.axis)
        if self.bias_index is not None and self.blobs[self.bias_index].shape != scale.shape:
            raise self.error('bias shape %s differs from scale shape %s'
                             % (self.blobs[self.bias_index].shape, scale.shape))
        if top[0] is not x:
            top[0].reshape(x.shape)

    def forward(self, bottom, top):
        x = bottom[0].data
        # in place, the input is overwritten but the scale gradient needs it
        self._saved_input = x.copy() if top[0] is bottom[0] else None
        outer, dim, inner = self.dims
        y = x.reshape(outer, dim, inner) * self._scale_blob(bottom).data.reshape(1, dim, 1)
        if self.bias_index is not None:
            y += self.blobs[self.bias_index].data.reshape(1, dim, 1)
        top[0].data[...] = y.reshape(x.shape)

    def backward(self, top, propagate_down, bottom):
        scale = self._scale_blob(bottom)
        outer, dim, inner = self.dims
        dy3 = top[0].diff.reshape(outer, dim, inner)
        # read the top diff fully before writing bottom 0's diff: in place they are one array
        if self.bias_index is not None and self.wants_param_gradient(self.bias_index):
            bias = self.blobs[self.bias_index]
            bias.diff += operand_sum(dy3, bias.shape)
        learned = len(bottom) == 1
        if (learned and self.wants_param_gradient(0)) or (not learned and propagate_down[1]):
            x = self._saved_input if self._saved_input is not None else bottom[0].data
            scale_grad = operand_sum(dy3 * x.reshape(outer, dim, inner), scale.shape)
            if learned:
                scale.diff += scale_grad
            else:
                scale.diff[...] = scale_grad
        if propagate_down[0]:
            dx = dy3 * scale.data.reshape(1, dim, 1)
            bottom[0].diff[...] = dx.reshape(bottom[0].shape)


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
        dy3 = top[0].diff.reshape(self.dims)
        if len(bottom) == 1:
            if self.wants_param_gradient(0):
                bias.diff += operand_sum(dy3, bias.shape)
        elif propagate_down[1]:
            bias.diff[...] = operand_sum(dy3, bias.shape)
        if propagate_down[0] and bottom[0] is not top[0]:
            bottom[0].diff[...] = top[0].diff
