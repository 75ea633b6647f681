"""Element-wise neuron layers: one bottom, one top of the same shape, in place allowed."""
import math

import numpy as np

from ... import caffe_pb2
from ...backend.cpu_threads import blocks, scratch_array, zeros
from ...layer import TRAIN, Layer, register


def relu(xp, x, negative_slope, out):
    """out = x where x > 0, else x * negative_slope (out may be x), over arrays of any
    shape; on numpy against an array of zeros, which it runs faster than a scalar 0."""
    if negative_slope == 0 and xp is np:
        np.maximum(x, zeros(x.shape[-1], x.dtype), out=out)
    elif negative_slope == 0:
        xp.maximum(x, 0, out=out)
    else:
        out[...] = xp.where(x > 0, x, x * negative_slope)


def relu_gradient(xp, y, dy, negative_slope, out):
    """out = dy where y > 0, else dy * negative_slope (out may be dy): ReLU's gradient,
    from its input or its output, whose signs agree for a slope >= 0."""
    if negative_slope == 0 and xp is np:       # the mask in a buffer, not a new array
        mask = scratch_array('relu', y.shape, np.bool_)
        np.multiply(dy, np.greater(y, 0, out=mask), out=out)
    elif negative_slope == 0:
        xp.multiply(dy, y > 0, out=out)
    else:
        out[...] = xp.where(y > 0, dy, dy * negative_slope)


class NeuronLayer(Layer):
    """Base of the element-wise layers.

    Subclasses define ``activate(x)`` and ``gradient(x, y, dy)``. Those whose gradient
    needs the input set ``needs_input``: an in-place forward overwrites it, so a copy
    is kept then.
    """

    needs_input = False

    def reshape(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def rerunnable(self):
        return True

    def forward(self, bottom, top):
        x = bottom[0].data
        self._saved_input = x.copy() if self.needs_input and top[0] is bottom[0] else None
        top[0].data[...] = self.activate(x)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        x = self._saved_input if self._saved_input is not None else bottom[0].data
        bottom[0].diff[...] = self.gradient(x, top[0].data, top[0].diff)

    def activate(self, x):
        raise NotImplementedError

    def gradient(self, x, y, dy):
        raise NotImplementedError


@register('ReLU')
class ReLULayer(NeuronLayer):
    """max(x, 0), or x * negative_slope below 0; written in place, block by block."""

    def setup(self, bottom, top):
        self.slope = self.param.relu_param.negative_slope

    def forward(self, bottom, top):
        xp = self.xp
        x, y = bottom[0].data.reshape(-1), top[0].data.reshape(-1)

        def work(a, b):
            relu(xp, x[a:b], self.slope, y[a:b])
        blocks(xp, x.size, 1, work)

    def backward_reads(self, bottom, top):
        return list(bottom)         # in place, the output, whose sign is the input's

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        xp = self.xp
        # in place, x is the output, whose sign matches the input's for a slope >= 0
        x, dy = bottom[0].data.reshape(-1), top[0].diff.reshape(-1)
        dx = bottom[0].diff.reshape(-1)

        def work(a, b):
            relu_gradient(xp, x[a:b], dy[a:b], self.slope, dx[a:b])
        blocks(xp, x.size, 1, work)


@register('PReLU')
class PReLULayer(NeuronLayer):
    """ReLU with learned negative slopes, one per channel (axis 1) or one shared."""

    needs_input = True

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        p = self.param.prelu_param
        if bottom[0].num_axes < 2:
            raise self.error('needs a bottom with >= 2 axes (N, C, ...), got shape %s'
                             % (bottom[0].shape,))
        filler = p.filler if p.HasField('filler') else \
            caffe_pb2.FillerParameter(type='constant', value=0.25)
        self.channel_shared = p.channel_shared
        shape = () if self.channel_shared else (bottom[0].shape[1],)
        self.blobs = [self.make_blob(shape, filler)]

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        x = bottom[0]
        if x.num_axes < 2 or (not self.channel_shared and x.shape[1] != self.blobs[0].count):
            raise self.error('expected a bottom with %d channels on axis 1, got shape %s'
                             % (self.blobs[0].count, x.shape))

    def _slopes(self, ndim):
        if self.channel_shared:
            return self.blobs[0].data
        return self.blobs[0].data.reshape((-1,) + (1,) * (ndim - 2))

    def activate(self, x):
        return self.xp.where(x > 0, x, x * self._slopes(x.ndim))

    def backward(self, top, propagate_down, bottom):
        xp = self.xp
        x = self._saved_input if self._saved_input is not None else bottom[0].data
        dy = top[0].diff
        if self.wants_param_gradient(0):
            negative_part = xp.where(x > 0, 0, dy * x)
            axes = None if self.channel_shared else (0,) + tuple(range(2, x.ndim))
            self.blobs[0].diff += negative_part.sum(axis=axes)
        if propagate_down[0]:
            bottom[0].diff[...] = xp.where(x > 0, dy, dy * self._slopes(x.ndim))


@register('ELU')
class ELULayer(NeuronLayer):
    needs_input = True

    def setup(self, bottom, top):
        self.alpha = self.param.elu_param.alpha

    def activate(self, x):
        xp = self.xp
        return xp.where(x > 0, x, self.alpha * (xp.exp(xp.minimum(x, 0)) - 1))

    def gradient(self, x, y, dy):
        return self.xp.where(x > 0, dy, dy * (y + self.alpha))


@register('Sigmoid')
class SigmoidLayer(NeuronLayer):
    def activate(self, x):
        # the tanh form never overflows
        return 0.5 * self.xp.tanh(0.5 * x) + 0.5

    def gradient(self, x, y, dy):
        return dy * y * (1 - y)


@register('TanH')
class TanHLayer(NeuronLayer):
    def activate(self, x):
        return self.xp.tanh(x)

    def gradient(self, x, y, dy):
        return dy * (1 - y * y)


@register('AbsVal')
class AbsValLayer(NeuronLayer):
    needs_input = True

    def activate(self, x):
        return self.xp.abs(x)

    def gradient(self, x, y, dy):
        return dy * self.xp.sign(x)


@register('BNLL')
class BNLLLayer(NeuronLayer):
    """log(1 + exp(x)), computed without overflow."""

    needs_input = True

    def activate(self, x):
        xp = self.xp
        return xp.maximum(x, 0) + xp.log1p(xp.exp(-xp.abs(x)))

    def gradient(self, x, y, dy):
        # Caffe clips the exponent at 50
        e = self.xp.exp(self.xp.minimum(x, 50))
        return dy * e / (e + 1)


@register('Power')
class PowerLayer(NeuronLayer):
    """(shift + scale * x) ^ power."""

    needs_input = True

    def setup(self, bottom, top):
        p = self.param.power_param
        self.power, self.scale, self.shift = p.power, p.scale, p.shift

    def activate(self, x):
        xp = self.xp
        if self.scale == 0 or self.power == 0:
            value = 1.0 if self.power == 0 else self.shift ** self.power
            return xp.full(x.shape, value, x.dtype)
        base = x * self.scale + self.shift if self.shift != 0 else x * self.scale
        if self.power == 1:
            return base
        return xp.power(base, self.power)

    def gradient(self, x, y, dy):
        if self.scale == 0 or self.power == 0:
            return self.xp.zeros_like(dy)
        if self.power == 1:
            return dy * self.scale
        base = x * self.scale + self.shift
        return dy * (self.power * self.scale) * self.xp.power(base, self.power - 1)


@register('Exp')
class ExpLayer(NeuronLayer):
    """base ^ (shift + scale * x); base -1 means e."""

    def setup(self, bottom, top):
        p = self.param.exp_param
        if p.base != -1 and p.base <= 0:
            raise self.error('base must be > 0 (or -1 for e), got %g' % p.base)
        log_base = 1.0 if p.base == -1 else math.log(p.base)
        self.inner_scale = log_base * p.scale
        try:
            self.outer_scale = 1.0 if p.shift == 0 else math.exp(log_base * p.shift)
        except OverflowError:
            raise self.error('base ^ shift overflows (base %g, shift %g)' % (p.base, p.shift)) \
                from None

    def activate(self, x):
        y = self.xp.exp(x * self.inner_scale)
        return y * self.outer_scale if self.outer_scale != 1 else y

    def gradient(self, x, y, dy):
        return dy * y * self.inner_scale


@register('Log')
class LogLayer(NeuronLayer):
    """log_base(shift + scale * x); base -1 means e."""

    needs_input = True

    def setup(self, bottom, top):
        p = self.param.log_param
        if p.base != -1 and not (p.base > 0 and p.base != 1):
            raise self.error('base must be > 0 and not 1 (or -1 for e), got %g' % p.base)
        self.inv_log_base = 1.0 if p.base == -1 else 1.0 / math.log(p.base)
        self.scale, self.shift = p.scale, p.shift

    def activate(self, x):
        y = self.xp.log(x * self.scale + self.shift)
        return y * self.inv_log_base if self.inv_log_base != 1 else y

    def gradient(self, x, y, dy):
        return dy * (self.scale * self.inv_log_base) / (x * self.scale + self.shift)


@register('Threshold')
class ThresholdLayer(NeuronLayer):
    """1 where x > threshold, else 0. Forward only, as in Caffe."""

    def activate(self, x):
        return (x > self.param.threshold_param.threshold).astype(x.dtype)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            raise self.error('Threshold has no gradient (Caffe does not implement its backward)')


@register('Clip')
class ClipLayer(NeuronLayer):
    needs_input = True

    def setup(self, bottom, top):
        p = self.param.clip_param
        if not (p.HasField('min') and p.HasField('max')):
            raise self.error('clip_param needs both min and max')
        if p.min > p.max:
            raise self.error('clip_param min %g is larger than max %g' % (p.min, p.max))
        self.low, self.high = p.min, p.max

    def activate(self, x):
        return self.xp.clip(x, self.low, self.high)

    def gradient(self, x, y, dy):
        return dy * ((x >= self.low) & (x <= self.high))


@register('ReLU6')
class ReLU6Layer(NeuronLayer):
    """min(max(x, 0), 6), the ReLU6 of the MobileNet forks (chuanqi305/ssd, MobileNet-YOLO):
    no gradient at 0, nor at 6 and above. A relu_param negative_slope s adds s * min(x, 0), as
    the ReLU6 of an NVCaffe-based fork reads it. The gradient comes from the output, whose
    sign and range tell the input's, so it runs in place without a copy."""

    def setup(self, bottom, top):
        self.slope = self.param.relu_param.negative_slope
        if self.slope < 0:
            raise self.error('negative_slope must be >= 0 for ReLU6, got %g' % self.slope)

    def backward_reads(self, bottom, top):
        return list(top)

    def activate(self, x):
        y = self.xp.clip(x, 0, 6)
        if self.slope:
            y += x.dtype.type(self.slope) * self.xp.minimum(x, 0)
        return y

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y, dy = top[0].data, top[0].diff
        passes = (y > 0) & (y < 6)
        if self.slope:
            bottom[0].diff[...] = dy * self.xp.where(y < 0, dy.dtype.type(self.slope), passes)
        else:
            bottom[0].diff[...] = dy * passes


@register('Swish')
class SwishLayer(NeuronLayer):
    """x * sigmoid(beta * x)."""

    def setup(self, bottom, top):
        self.beta = self.param.swish_param.beta

    def activate(self, x):
        self._sigmoid = 0.5 * self.xp.tanh(0.5 * (x * self.beta)) + 0.5
        return x * self._sigmoid

    def gradient(self, x, y, dy):
        s = self._sigmoid
        return dy * (self.beta * y + s * (1 - self.beta * y))


@register('Dropout')
class DropoutLayer(NeuronLayer):
    """Inverted dropout: TRAIN keeps each value with probability 1 - ratio and scales it
    by 1/(1 - ratio); TEST is the identity. With ``scale_train: false`` (caffe-fast-rcnn's
    and R-FCN's Caffe) TRAIN does not scale and TEST multiplies by 1 - ratio instead, in
    both passes."""

    def setup(self, bottom, top):
        p = self.param.dropout_param
        self.ratio = p.dropout_ratio
        if not 0 <= self.ratio < 1:
            raise self.error('dropout_ratio must be in [0, 1), got %g' % self.ratio)
        self.scale = 1.0 / (1.0 - self.ratio)
        self.scale_train = p.scale_train

    def backward_reads(self, bottom, top):
        return []                   # the mask is kept

    def rerunnable(self):
        return False                # a new mask each time

    def activate(self, x):
        if self.phase == TRAIN:
            keep = self.ctx.rng.random_sample(x.shape) < 1.0 - self.ratio
            factor = self.scale if self.scale_train else 1.0
            self._multiplier = self.xp.asarray(keep.astype(x.dtype) * x.dtype.type(factor))
            return x * self._multiplier
        if self.scale_train:
            return x.copy()
        return x * (1.0 / self.scale)

    def gradient(self, x, y, dy):
        if self.phase == TRAIN:
            return dy * self._multiplier
        if self.scale_train:
            return dy.copy()
        return dy * (1.0 / self.scale)
