"""Batch normalization's math, below every engine, and the array engine itself.

Statistics are per channel (axis 1) over every other axis, viewed as (N, C, S). Every
per-channel statistic is float64 (``STAT``); elementwise work runs in the blob dtype, but
at least in float32 (``work_dtype``).

The layers of batch_norm.py hold the rules (which statistics, which collective, which running
update); an engine holds the passes over the data, with one signature in all three:

    local_sums(x3, reference=None)  -> (packed, shift): packed is the float64 array
        [count, sum(x - K) (C), sum((x - K)^2) (C)] about K = shift, which is
        ``reference`` when given (C values the blob dtype holds exactly), else a shift of
        the engine's choosing that keeps the sums free of cancellation
    normalize(x3, y3, mean, inv_std, slope=None, bias=None, keep=False, x_hat_out=None,
              activation=None)
        y = x_hat (* slope + bias), then through a ReLU of negative slope ``activation``
        unless it is None, into y3, which may be x3; with ``keep``, returns what the
        backward reads x_hat from (written into ``x_hat_out`` when given: the layer runs in
        place and x3 is gone; else made again from x3)
    gradient_sums(dy3, x_hat) -> (sum(dy), sum(dy * x_hat) or None when x_hat is None)
    input_gradient(dx3, dy3, scale, x_hat=None, sum_dy=None, sum_dy_x_hat=None, count=None)
        dx into dx3 (which may be dy3): scale * dy, or through batch statistics over
        ``count`` values scale * (dy - sum(dy)/m - x_hat * sum(dy*x_hat)/m)

and two for the chains of chain.py, whose output y = relu(gamma * x_hat + beta):

    x_hat_from_output(y3, gamma, beta, activation) -> what the backward reads x_hat from,
        found from y (gamma, beta None: no affine part; ``activation`` 0 only where the
        gradient through the ReLU, 0 where y <= 0, is all that meets x_hat)
    activation_gradient(y3, dy3, activation, x_hat) -> the gradient g through the ReLU,
        the dy the other functions then take with that x_hat (written over dy3)
    output_from_x_hat(x_hat, y3, slope, bias, activation): y into y3 again from a kept
        x_hat (normalize's ``keep`` into ``x_hat_out``), as normalize computed it

The layers keep their running statistics in one of three conventions, ``RunningSums``
(BVLC BatchNorm's), ``RunningAverage`` (the forks' momentum) and ``FirstCopyAverage``
(NVCaffe BatchNorm's momentum), defined here once.

This module is the engine for any array module (CuPy without the kernels, and the
tests' reference); host.py is the host engine (every float type, half blobs included) and
gpu.py the CUDA one.
"""
import math
import numpy as np

from ... import caffe_pb2
from ...backend import get_array_module
from ...weights.norm_forms import statistics_factor
from ..neuron.layers import relu, relu_gradient

STAT = np.float64   # dtype of every per-channel statistic


def channel_view(x):
    """(N, C, ...) -> (N, C, S); an (N, C) array is (N, C, 1), an (N,) one is (N, 1, 1)."""
    channels = x.shape[1] if x.ndim > 1 else 1
    return x.reshape(x.shape[0], channels, int(math.prod(x.shape[2:])))


def work_dtype(dtype):
    """Elementwise work runs in the blob dtype, but at least in float32."""
    return np.promote_types(dtype, np.float32)


def per_channel(v):
    return v.reshape(1, -1, 1)


# ---- per-channel math shared by the layers and the engines --------------------------------
def pack(xp, count, s1, s2):
    return xp.concatenate([xp.full(1, count, STAT), s1.astype(STAT), s2.astype(STAT)])


def rebase_sums(count, s1, s2, old_shift, new_shift):
    """The same sums taken about ``new_shift`` instead of ``old_shift`` (float64)."""
    e = old_shift.astype(STAT) - new_shift.astype(STAT)
    return s1 + count * e, s2 + 2 * e * s1 + count * e * e


def moments(packed, shift):
    """(count (1,), mean, BIASED variance), float64, from packed sums about ``shift``."""
    xp = get_array_module(packed)
    channels = shift.size
    count = packed[:1]
    delta = packed[1:1 + channels] / count
    return count, shift.astype(STAT) + delta, \
        xp.maximum(packed[1 + channels:] / count - delta * delta, 0)


def unbiased(var, count):
    """The unbiased variance of ``count`` values from the biased one (itself for 1 value)."""
    return var * (count / get_array_module(count).maximum(count - 1, 1))


def inverse_std(var, eps):
    return 1.0 / get_array_module(var).sqrt(var + eps)


# ---- the two conventions of running statistics, in a layer's blobs [first, ...) ------------
# (looked up at every use: a test net shares the train net's blobs by taking them over)
def _values(layer, j):
    return layer.blobs[j].data.reshape(-1).astype(STAT)


def _store(layer, j, values, kept=None):
    """Blob j := ``values``, or, where the 0-d boolean ``kept`` holds (a batch whose
    statistics are not finite), its old values: chosen on the device, never read back."""
    blob = layer.blobs[j]
    values = values.reshape(blob.shape).astype(blob.data.dtype)
    if kept is not None:
        values = get_array_module(values).where(kept, blob.data, values)
    blob.data[...] = values


class RunningSums:
    """BVLC BatchNorm's running statistics, blobs [first, first + 3) of ``layer``: mean_sum,
    var_sum and the scale factor s. Each TRAIN step s = f*s + 1, mean_sum = f*mean_sum +
    mean and var_sum = f*var_sum + the unbiased variance (f: moving_average_fraction); the
    running statistics are the sums / s, 0 while s is 0. The first batches weigh alike, where
    an average started at 0 would weigh them by (1 - f)."""

    def __init__(self, layer, first, fraction):
        self.layer, self.first, self.fraction = layer, first, fraction

    @staticmethod
    def blob_shapes(channel_shape):
        return [channel_shape, channel_shape, (1,)]

    def start_frozen(self):
        """Caffe's zeros stay: s = 0 reads as mean 0 and var 0."""

    def running(self):
        layer, j = self.layer, self.first
        factor = _values(layer, j + 2)
        inverse = 1.0 / get_array_module(factor).where(factor == 0, np.inf, factor)
        return _values(layer, j) * inverse, _values(layer, j + 1) * inverse

    def update(self, count, mean, var, kept=None):
        """One TRAIN step's update; where ``kept`` holds, none (see _store)."""
        layer, j, f = self.layer, self.first, self.fraction
        _store(layer, j + 2, _values(layer, j + 2) * f + 1, kept)
        _store(layer, j, _values(layer, j) * f + mean, kept)
        _store(layer, j + 1, _values(layer, j + 1) * f + unbiased(var, count), kept)

    def population(self, count, mean, var):
        """Hold the statistics of ``count`` values (their mean and biased variance): the
        mean and the unbiased variance times s, and s the factor Caffe's s tends to as it
        trains (a power of two, weights/norm_forms.statistics_factor). TEST reads them back
        exactly, and a training that resumes weighs them as a full history."""
        layer, j = self.layer, self.first
        factor = statistics_factor(self.fraction)
        _store(layer, j + 2, get_array_module(mean).full(1, factor, STAT))
        _store(layer, j, mean * factor)
        _store(layer, j + 1, unbiased(var, count) * factor)


class RunningAverage:
    """The forks' running statistics, blobs [first, first + 2) of ``layer``: mean and var,
    each running = momentum*running + (1-momentum)*batch, of the batch variance biased (BN)
    or ``unbiased`` (SyncBN)."""

    def __init__(self, layer, first, momentum, unbiased_variance):
        self.layer, self.first, self.momentum = layer, first, momentum
        self.unbiased_variance = unbiased_variance

    @staticmethod
    def blob_shapes(channel_shape):
        return [channel_shape, channel_shape]

    def start_frozen(self):
        """Unit variance until weights load, as the forks' frozen BN starts."""
        self.layer.blobs[self.first + 1].data[...] = 1

    def running(self):
        return _values(self.layer, self.first), _values(self.layer, self.first + 1)

    def update(self, count, mean, var, kept=None):
        """One TRAIN step's update; where ``kept`` holds, none (see _store)."""
        layer, j, keep = self.layer, self.first, self.momentum
        if self.unbiased_variance:
            var = unbiased(var, count)
        _store(layer, j, keep * _values(layer, j) + (1 - keep) * mean, kept)
        _store(layer, j + 1, keep * _values(layer, j + 1) + (1 - keep) * var, kept)

    def population(self, count, mean, var):
        """Hold the statistics of ``count`` values (their mean and biased variance), the
        variance as ``update`` takes a batch's."""
        _store(self.layer, self.first, mean)
        _store(self.layer, self.first + 1, unbiased(var, count) if self.unbiased_variance else var)


class FirstCopyAverage(RunningAverage):
    """NVCaffe BatchNorm's running statistics: RunningAverage, whose update copies the
    batch's statistics at first. NVCaffe's cuDNN engine (its default) copies at the solver's
    iteration 0, when a new layer's statistics are still zero: here, while they are all zero
    (``copies`` None), with the unbiased variance. Its CAFFE engine copies on the first
    ``copies`` (2) TRAIN forwards of the layer, with the biased variance."""

    #: NVCaffe's CAFFE engine copies the batch's statistics on its first two TRAIN forwards
    CAFFE_ENGINE_COPIES = 2

    def __init__(self, layer, first, momentum, unbiased_variance, copies=None):
        super().__init__(layer, first, momentum, unbiased_variance)
        self.copies, self.updates = copies, 0

    @classmethod
    def of_engine(cls, layer, first, momentum, engine):
        """The statistics of NVCaffe's BatchNorm (or a SyncBN made of one) in blobs [first,
        first + 2) of ``layer``, as ``engine`` keeps them (a BatchNormParameter or
        BNParameter Engine value: the two enums agree)."""
        if engine == caffe_pb2.BatchNormParameter.CAFFE:
            return cls(layer, first, momentum, unbiased_variance=False,
                       copies=cls.CAFFE_ENGINE_COPIES)
        return cls(layer, first, momentum, unbiased_variance=True)

    def start_frozen(self):
        """NVCaffe's BatchNorm is never frozen: its phase decides."""

    def update(self, count, mean, var, kept=None):
        """One TRAIN step's update; where ``kept`` holds, none (see _store)."""
        layer, j, keep = self.layer, self.first, self.momentum
        if self.unbiased_variance:
            var = unbiased(var, count)
        old_mean, old_var = _values(layer, j), _values(layer, j + 1)
        xp = get_array_module(old_mean)
        if self.copies is None:         # on the device: no read of it
            copy = xp.logical_and((old_mean == 0).all(), (old_var == 0).all())
        else:
            copy = self.updates < self.copies
            self.updates += 1
        _store(layer, j, xp.where(copy, mean, keep * old_mean + (1 - keep) * mean), kept)
        _store(layer, j + 1, xp.where(copy, var, keep * old_var + (1 - keep) * var), kept)


# ---- the array engine ------------------------------------------------------------------------
def local_sums(x3, reference=None):
    """Sums about this batch's own mean (two passes, no cancellation), moved to
    ``reference`` in float64 when given."""
    xp = get_array_module(x3)
    count, channels = x3.shape[0] * x3.shape[2], x3.shape[1]
    dtype = work_dtype(x3.dtype)
    if count == 0:
        zero = xp.zeros(channels, STAT)
        return pack(xp, 0, zero, zero), zero if reference is None else reference
    shift = x3.mean(axis=(0, 2), dtype=dtype).astype(dtype)
    d = x3 - per_channel(shift)
    s1 = d.sum(axis=(0, 2)).astype(STAT)
    d *= d
    s2 = d.sum(axis=(0, 2)).astype(STAT)
    if reference is None:
        return pack(xp, count, s1, s2), shift.astype(STAT)
    return pack(xp, count, *rebase_sums(count, s1, s2, shift, reference)), reference


def x_hat_of(x3, mean, inv_std):
    """x_hat = ((x - K) - (mean - K)) * inv_std in the work dtype, K = the mean rounded to
    that dtype: x - K is exact for x near the mean and (mean - K) is tiny, so a large
    mean costs no precision."""
    dtype = work_dtype(x3.dtype)
    shift = mean.astype(dtype)
    x_hat = x3 - per_channel(shift)
    x_hat -= per_channel((mean - shift.astype(STAT)).astype(dtype))
    x_hat *= per_channel(inv_std.astype(dtype))
    return x_hat


def normalize(x3, y3, mean, inv_std, slope=None, bias=None, keep=False, x_hat_out=None,
              activation=None):
    x_hat = x_hat_of(x3, mean, inv_std)
    output_from_x_hat(x_hat, y3, slope, bias, activation)
    if not keep:
        return None
    if x_hat_out is not None:
        x_hat_out[...] = x_hat
        return x_hat_out
    # kept in the blob dtype, as the CUDA engine keeps it: half blobs keep half of float32's
    return x_hat.astype(x3.dtype, copy=False)


def output_from_x_hat(x_hat, y3, slope, bias, activation):
    y = x_hat if slope is None else \
        x_hat * per_channel(slope.astype(x_hat.dtype)) + per_channel(bias.astype(x_hat.dtype))
    if activation is not None:             # in the work dtype, before y3's rounding
        activated = get_array_module(y).empty_like(y)
        relu(get_array_module(y), y, activation, activated)
        y = activated
    y3[...] = y


def x_hat_from_output(y3, gamma, beta, activation):
    xp = get_array_module(y3)
    dtype = work_dtype(y3.dtype)
    p = y3.astype(dtype)
    if activation:                  # slope 0: p = y, whose gradient is 0 where y <= 0
        p = xp.where(p > 0, p, p / dtype.type(activation))
    if gamma is not None:
        p = (p - per_channel(beta.astype(dtype))) / per_channel(gamma.astype(dtype))
    return p


def activation_gradient(y3, dy3, activation, x_hat):
    if activation is not None:
        relu_gradient(get_array_module(dy3), y3, dy3, activation, dy3)
    return dy3


def gradient_sums(dy3, x_hat):
    # summed in float64: a half diff's sums (mixed precision's loss scale makes them large)
    # pass float16's range where dy3 does not
    xp = get_array_module(dy3)
    sum_dy = dy3.sum(axis=(0, 2), dtype=STAT)
    if x_hat is None:
        return sum_dy, None
    products = xp.multiply(dy3, x_hat, dtype=work_dtype(dy3.dtype))
    return sum_dy, products.sum(axis=(0, 2), dtype=STAT)


def input_gradient(dx3, dy3, scale, x_hat=None, sum_dy=None, sum_dy_x_hat=None, count=None):
    xp = get_array_module(dy3)
    dtype = work_dtype(dy3.dtype)
    dx = dy3 * per_channel(scale.astype(dtype))
    if sum_dy is not None:
        m = xp.maximum(count, 1)
        dx -= x_hat * per_channel((scale * sum_dy_x_hat / m).astype(dtype))
        dx -= per_channel((scale * sum_dy / m).astype(dtype))
    dx3[...] = dx
