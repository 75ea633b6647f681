"""SyncBN and BN on the GPU: the kernels of cuda/syncbn.cu behind the steps of layers/norm.py.

Two levels:

* Drop-in replacements of norm.py's named steps, with the same arguments and results:
  ``local_statistics``, ``normalize``, ``gradient_sums``, ``batch_input_gradient``.
* ``layer_forward`` / ``layer_backward``: the whole BN/SyncBN forward and backward in 5
  launches each way plus the one allreduce, with no host synchronisation (the global
  count stays on the device) and without keeping x_hat unless the layer runs in place.
  Forward reads x twice and writes y once; backward reads x and dy twice and writes dx.

The buffers that cross replicas are float64 and laid out as in norm.py, so a replica's
``comm.allreduce(packed, tag=layer name)`` is the same collective on CPU and GPU.
"""
import numpy as np

from ..backend import cuda_kernels, get_array_module
from ..backend.launch import (BLOCK, BLOCKS_PER_SM, contiguous, f64, grid_1d, grid_channels, i32,
                              i64, vector_width)
from .norm_math import STAT, channel_view, work_dtype

MODE_RUNNING, MODE_BATCH_BIASED, MODE_BATCH_UNBIASED = 0, 1, 2
MAX_CHANNELS = 65535          # the grid's y extent


def _kernel(base, dtype):
    return cuda_kernels.typed_kernel('syncbn', base, dtype)


def _splits(x3):
    """Blocks per channel for the per-channel reductions: enough blocks to fill the GPU when
    C is small, but at least ~4 vector loads per thread."""
    n, c, hw = x3.shape
    if c > MAX_CHANNELS:
        raise ValueError('the SyncBN kernels take at most %d channels, got %d' % (MAX_CHANNELS, c))
    if n * hw >= 2 ** 31:       # their unsigned loops step past the end: keep clear of 2^32
        raise ValueError('the SyncBN kernels take < 2^31 values per channel, got %d' % (n * hw))
    width = vector_width(x3.dtype) if hw % vector_width(x3.dtype) == 0 else 1
    vectors = n * hw // width
    target = cuda_kernels.multiprocessor_count() * BLOCKS_PER_SM
    return max(1, min(-(-target // c), -(-vectors // (BLOCK * 4))))


def _acc_dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


# ---- the steps -------------------------------------------------------------------------------
def packed_stats(x3, shift=None):
    """[count, sum(x-K) (C), sum((x-K)^2) (C)] (float64) of this replica, K = ``shift`` (C values
    of x's dtype), and the per-channel pivots p the kernel summed about (shift None: K = p)."""
    xp = get_array_module(x3)
    n, c, hw = x3.shape
    packed = xp.zeros(1 + 2 * c, STAT)
    pivot = xp.zeros(c, STAT)
    if n * hw == 0:
        return packed, pivot
    x3 = contiguous(xp, x3)
    splits = _splits(x3)
    partial = xp.empty(c * splits * 2, STAT)
    _kernel('syncbn_local_stats', x3.dtype)(
        (splits, c), (BLOCK,), (x3, i32(n), i32(c), i64(hw), i32(splits), partial, pivot))
    _kernel('syncbn_stats_finish', x3.dtype)(
        grid_channels(c), (BLOCK,), (partial, i32(splits), i32(c), pivot, shift, f64(n * hw), packed))
    return packed, pivot


def prepare(packed, running_mean, running_var, slope, bias, eps, momentum, mode):
    """The per-channel [mean_hi, mean_lo, invstd, slope*invstd, bias] (acc dtype, 5C) from the
    all-reduced ``packed`` buffer (modes 1, 2: also updates the running stats in place) or
    from the running stats (mode 0)."""
    xp = get_array_module(running_mean)
    c = running_mean.size
    params = xp.empty(5 * c, _acc_dtype(running_mean.dtype))
    _kernel('syncbn_prepare', running_mean.dtype)(
        grid_channels(c), (BLOCK,),
        (packed, i32(c), running_mean, running_var, slope, bias, f64(eps), f64(momentum),
         i32(mode), params))
    return params


def normalize_affine(x3, y3, params, xhat3=None):
    """y = x_hat*slope + bias into ``y3`` (may be ``x3``); x_hat into ``xhat3`` if given."""
    total = x3.size
    if total == 0:
        return
    n, c, hw = x3.shape
    _kernel('syncbn_normalize', x3.dtype)(
        grid_1d(total // vector_width(x3.dtype) or 1), (BLOCK,),
        (x3, y3, xhat3, params, i64(c), i64(hw), i64(total)))


def backward_sums(x3, dy3, params, x_is_xhat, dslope=None, dbias=None):
    """[sum(dy) (C), sum(dy*x_hat) (C)] (float64) of this replica; the same sums are added
    to ``dslope`` and ``dbias`` (the param diffs, C values) where given."""
    xp = get_array_module(dy3)
    n, c, hw = dy3.shape
    sums = xp.zeros(2 * c, STAT)
    if n * hw == 0:
        return sums
    splits = _splits(dy3)
    partial = xp.empty(c * splits * 2, STAT)
    _kernel('syncbn_backward_reduce', dy3.dtype)(
        (splits, c), (BLOCK,),
        (x3, dy3, params, i32(x_is_xhat), i32(n), i32(c), i64(hw), i32(splits), partial))
    _kernel('syncbn_grad_finish', dy3.dtype)(
        grid_channels(c), (BLOCK,), (partial, i32(splits), i32(c), sums, dslope, dbias))
    return sums


def input_gradient(x3, dy3, dx3, params, x_is_xhat, sums=None, count=None):
    """dx into ``dx3`` (may be ``dy3``): through the batch statistics of ``count[0]`` values
    with the global ``sums``, or (sums None) through fixed statistics."""
    total = dy3.size
    if total == 0:
        return
    n, c, hw = dy3.shape
    _kernel('syncbn_backward_dx', dy3.dtype)(
        grid_1d(total // vector_width(dy3.dtype) or 1), (BLOCK,),
        (x3, dy3, dx3, params, i32(x_is_xhat), sums, count, i64(c), i64(hw), i64(total)))


# ---- drop-ins for the named steps of layers/norm.py ---------------------------------------------
def local_statistics(x3, xp=None):
    """(count, shift, s1, s2) as norm.local_statistics, in one pass: the shift is each
    channel's first value, which keeps the sums as free of cancellation as the batch mean."""
    count = x3.shape[0] * x3.shape[2]
    packed, pivot = packed_stats(x3)
    c = x3.shape[1]
    return count, pivot, packed[1:1 + c], packed[1 + c:]


def _xhat_params(xp, c, dtype, scale):
    """params for kernels that read x_hat itself: only the scale (slope*invstd) is used."""
    params = xp.zeros(5 * c, _acc_dtype(dtype))
    params[3 * c:4 * c] = scale
    return params


def normalize(x3, mean, inv_std):
    """x_hat as norm.normalize (work dtype) from float64 per-channel mean and 1/std."""
    xp = get_array_module(x3)
    x3 = contiguous(xp, x3.astype(work_dtype(x3.dtype), copy=False))
    acc = _acc_dtype(x3.dtype)
    hi = mean.astype(acc)
    zeros = xp.zeros(mean.size, acc)
    params = xp.concatenate([hi, (mean - hi.astype(STAT)).astype(acc), inv_std.astype(acc),
                             inv_std.astype(acc), zeros])
    x_hat = xp.empty_like(x3)
    normalize_affine(x3, x_hat, params)
    return x_hat


def _same_dtype(xp, dy3, x_hat3):
    return contiguous(xp, dy3.astype(x_hat3.dtype, copy=False)), contiguous(xp, x_hat3)


def gradient_sums(dy3, x_hat3):
    """(sum(dy), sum(dy*x_hat)) per channel, float64, as norm.gradient_sums."""
    xp = get_array_module(dy3)
    dy3, x_hat3 = _same_dtype(xp, dy3, x_hat3)
    c = dy3.shape[1]
    sums = backward_sums(x_hat3, dy3, _xhat_params(xp, c, dy3.dtype, 0), 1)
    return sums[:c], sums[c:]


def batch_input_gradient(dy3, x_hat3, scale, sum_dy, sum_dy_x_hat, count):
    """dx as norm.batch_input_gradient (work dtype)."""
    xp = get_array_module(dy3)
    dy3, x_hat3 = _same_dtype(xp, dy3, x_hat3)
    c = dy3.shape[1]
    dx = xp.empty_like(dy3)
    input_gradient(x_hat3, dy3, dx, _xhat_params(xp, c, dy3.dtype, scale.astype(STAT)), 1,
                   xp.concatenate([sum_dy, sum_dy_x_hat]).astype(STAT),
                   xp.full(1, max(count, 1), STAT))
    return dx


# ---- the fused layer passes ----------------------------------------------------------------------
def _is_sync(layer):
    return layer.type == 'SyncBN'


def layer_forward(layer, bottom, top):
    """BN/SyncBN forward (layers.norm.BN or SyncBN ``layer``) on CuPy arrays."""
    xp = get_array_module(bottom[0].data)
    x3 = contiguous(xp, channel_view(bottom[0].data))
    y3 = channel_view(top[0].data)
    slope, bias, mean, var = (b.data.reshape(-1) for b in layer.blobs)
    in_place = top[0] is bottom[0] or top[0].data is bottom[0].data
    state = {'count': None, 'x_is_xhat': 0, 'xhat': None}
    if layer.use_running_stats:
        packed, mode = None, MODE_RUNNING
        state['count'] = xp.full(1, x3.shape[0] * x3.shape[2], STAT)
    else:
        packed, _ = packed_stats(x3, mean)
        if _is_sync(layer) and layer.ctx.comm is not None:
            layer.ctx.comm.allreduce(packed, tag=layer.name)
        if x3.shape[0] * x3.shape[2] == 0 and float(packed[0]) == 0:   # reads back only here
            raise layer.error('the global batch is empty (local shape %s on every replica)'
                              % (x3.shape,))
        mode = MODE_BATCH_UNBIASED if _is_sync(layer) else MODE_BATCH_BIASED
        state['count'] = packed[:1]
    state['params'] = prepare(packed, mean, var, slope, bias, layer.eps, layer.momentum, mode)
    if in_place and not layer.affine_frozen:
        state['xhat'], state['x_is_xhat'] = xp.empty_like(x3), 1
    normalize_affine(x3, y3, state['params'], state['xhat'])
    layer._gpu_state = state


def layer_backward(layer, top, propagate_down, bottom):
    """BN/SyncBN backward on CuPy arrays, after ``layer_forward``."""
    xp = get_array_module(top[0].diff)
    state = layer._gpu_state
    dy3 = contiguous(xp, channel_view(top[0].diff))
    dx3 = channel_view(bottom[0].diff)
    x3 = state['xhat'] if state['x_is_xhat'] else contiguous(xp, channel_view(bottom[0].data))
    if layer.affine_frozen:
        if propagate_down[0]:
            input_gradient(x3, dy3, dx3, state['params'], state['x_is_xhat'])
        return
    dslope = layer.blobs[layer.SLOPE].diff.reshape(-1) \
        if layer.wants_param_gradient(layer.SLOPE) else None
    dbias = layer.blobs[layer.BIAS].diff.reshape(-1) \
        if layer.wants_param_gradient(layer.BIAS) else None
    sums = backward_sums(x3, dy3, state['params'], state['x_is_xhat'], dslope, dbias)
    if not propagate_down[0]:
        return
    if _is_sync(layer) and layer.use_running_stats:    # the true gradient of the TEST forward
        input_gradient(x3, dy3, dx3, state['params'], state['x_is_xhat'])
        return
    if _is_sync(layer) and layer.ctx.comm is not None:
        layer.ctx.comm.allreduce(sums, tag=layer.name)
    input_gradient(x3, dy3, dx3, state['params'], state['x_is_xhat'], sums, state['count'])
