"""Batch normalization's math as array code (numpy or CuPy), below every engine.

Statistics are per channel (axis 1) over every other axis, viewed as (N, C, S). The
per-channel statistics are float64 (``STAT``); elementwise work runs in the blob dtype,
but at least float32 (``work_dtype``).
"""
import numpy as np

STAT = np.float64   # dtype of every per-channel statistic


# ---- the math shared by the three layers ---------------------------------------------------
def channel_view(x):
    """(N, C, ...) -> (N, C, S); an (N, C) array is (N, C, 1), an (N,) one is (N, 1, 1)."""
    channels = x.shape[1] if x.ndim > 1 else 1
    return x.reshape(x.shape[0], channels, int(np.prod(x.shape[2:], dtype=np.int64)))


def work_dtype(dtype):
    """Elementwise work runs in the blob dtype, but at least in float32."""
    return np.promote_types(dtype, np.float32)


def per_channel(v):
    return v.reshape(1, -1, 1)


def local_shifted_sums(x3, shift):
    """Per-channel sum(x - shift) and sum((x - shift)^2) over axes 0 and 2, as float64."""
    d = x3 - per_channel(shift)
    s1 = d.sum(axis=(0, 2)).astype(STAT)
    d *= d
    return s1, d.sum(axis=(0, 2)).astype(STAT)


def local_statistics(x3, xp):
    """(count, shift, s1, s2): the shifted sums about this batch's own mean (the shift,
    rounded to the work dtype), so that s2 carries no cancellation."""
    count = x3.shape[0] * x3.shape[2]
    dtype = work_dtype(x3.dtype)
    if count == 0:
        zero = xp.zeros(x3.shape[1], STAT)
        return 0, zero.astype(dtype), zero, zero
    shift = x3.mean(axis=(0, 2), dtype=dtype).astype(dtype)
    return (count, shift) + local_shifted_sums(x3, shift)


def rebase_sums(count, s1, s2, old_shift, new_shift):
    """The same sums taken about ``new_shift`` instead of ``old_shift`` (float64)."""
    e = old_shift.astype(STAT) - new_shift.astype(STAT)
    return s1 + count * e, s2 + 2 * e * s1 + count * e * e


def moments(count, s1, s2, shift, xp):
    """Per-channel mean and BIASED variance (float64) of ``count`` values from their sums
    about ``shift``."""
    delta = s1 / count
    return shift.astype(STAT) + delta, xp.maximum(s2 / count - delta * delta, 0)


def normalize(x3, mean, inv_std):
    """x_hat = ((x - K) - (mean - K)) * inv_std in the work dtype, K = the mean rounded to
    that dtype: x - K is exact for x near the mean and (mean - K) is tiny, so a large
    mean costs no precision."""
    dtype = work_dtype(x3.dtype)
    shift = mean.astype(dtype)
    x_hat = x3 - per_channel(shift)
    x_hat -= per_channel((mean - shift.astype(STAT)).astype(dtype))
    x_hat *= per_channel(inv_std.astype(dtype))
    return x_hat


def gradient_sums(dy3, x_hat3):
    """Per-channel sum(dy) and sum(dy * x_hat) over axes 0 and 2, as float64."""
    return dy3.sum(axis=(0, 2)).astype(STAT), (dy3 * x_hat3).sum(axis=(0, 2)).astype(STAT)


def batch_input_gradient(dy3, x_hat3, scale, sum_dy, sum_dy_x_hat, count):
    """dx = scale * (dy - sum(dy)/m - x_hat * sum(dy*x_hat)/m): the gradient through
    statistics taken over m = ``count`` values (scale = slope / std)."""
    dtype = work_dtype(dy3.dtype)
    m = max(count, 1)
    dx = dy3 * per_channel(scale.astype(dtype))
    dx -= x_hat3 * per_channel((scale * sum_dy_x_hat / m).astype(dtype))
    dx -= per_channel((scale * sum_dy / m).astype(dtype))
    return dx


def inverse_std(var, eps, xp):
    return 1.0 / xp.sqrt(var + eps)
