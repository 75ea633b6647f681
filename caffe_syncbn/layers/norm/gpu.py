"""Batch normalization's CUDA engine: the kernels of cuda/norm.cu behind the functions every
engine has (see array.py), and those for the chains of chain.py: a ReLU in the same pass as
the normalization, and a backward that finds x_hat and the ReLU's gradient from the output
as it goes.

Each per-channel reduction is two launches (partial sums per block, then per channel),
each elementwise pass one launch, and nothing is read back to the host: the global count
stays on the device. Sums are float64 and laid out as in array.py, so the layer's
allreduce is the same collective on CPU and GPU.
"""
import numpy as np

from ...backend import cuda_kernels, get_array_module
from ...backend.launch import (BLOCK, BLOCKS_PER_SM, contiguous, f64, grid_1d, grid_channels, i32,
                               i64, vector_width)
from .array import STAT

MAX_CHANNELS = 65535          # the grid's y extent


def _kernel(base, dtype, family='norm'):
    return cuda_kernels.typed_kernel(family, base, dtype)


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


# ---- the kernels -------------------------------------------------------------------------------
def _packed_stats(x3, shift=None):
    """[count, sum(x-K) (C), sum((x-K)^2) (C)] (float64), K = ``shift`` (C values of x's
    dtype), and the per-channel pivots p the kernel summed about (shift None: K = p)."""
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
        grid_channels(c), (BLOCK,), (partial, i32(splits), i32(c), pivot, shift, f64(n * hw),
                                     packed))
    return packed, pivot


def _accumulator(dtype):
    """The kernels' accumulator type: float64 for float64 data, else float32."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def _params(xp, dtype, mean, inv_std, scale, bias):
    """The kernels' per-channel [mean_hi, mean_lo, inv_std, scale, bias] (5C, acc dtype):
    mean split in two so that x - mean loses nothing to a large mean."""
    acc = _accumulator(dtype)
    hi = mean.astype(acc)
    return xp.concatenate([hi, (mean - hi.astype(STAT)).astype(acc), inv_std.astype(acc),
                           scale.astype(acc), bias.astype(acc)])


class XHat:
    """Where the backward kernels find x_hat: ``source`` is x_hat itself (``is_x_hat``) or
    the input, which they normalize again with ``params``."""

    def __init__(self, source, params, is_x_hat):
        self.source, self.params, self.is_x_hat = source, params, is_x_hat


class FromOutput:
    """A chain's output y, its gamma and beta (in y's dtype) and its ReLU's negative slope
    (1: no ReLU, which the fused kernels then pass through): they find x_hat and the
    gradient through the ReLU from y themselves."""

    def __init__(self, y3, gamma, beta, negative_slope):
        self.y3, self.gamma, self.beta, self.negative_slope = y3, gamma, beta, negative_slope


# ---- the engine --------------------------------------------------------------------------------
def local_sums(x3, reference=None):
    """One pass about each channel's first value (as free of cancellation as the batch
    mean), moved to ``reference`` on the device when given."""
    packed, pivot = _packed_stats(x3, None if reference is None else reference.astype(x3.dtype))
    return packed, pivot if reference is None else reference


def normalize(x3, y3, mean, inv_std, slope=None, bias=None, keep=False, x_hat_out=None,
              activation=None):
    xp = get_array_module(x3)
    x3 = contiguous(xp, x3)
    if slope is None:
        slope, bias = xp.ones(mean.size, STAT), xp.zeros(mean.size, STAT)
    params = _params(xp, x3.dtype, mean, inv_std, slope.astype(STAT) * inv_std, bias)
    x_hat_out = x_hat_out if keep else None
    c, hw = i64(x3.shape[1]), i64(x3.shape[2])
    if x3.size and activation is not None and x_hat_out is None:
        _kernel('fused_bn_relu_forward', x3.dtype)(
            grid_1d(x3.size), (BLOCK,), (x3, params, c, hw, i64(x3.size), f64(activation), y3))
    elif x3.size:
        _kernel('syncbn_normalize', x3.dtype)(
            grid_1d(x3.size // vector_width(x3.dtype) or 1), (BLOCK,),
            (x3, y3, x_hat_out, params, c, hw, i64(x3.size)))
        if activation is not None:        # x_hat kept: the ReLU over y, in place
            ones = xp.ones(x3.shape[1], _accumulator(x3.dtype))
            _kernel('fused_affine_relu', x3.dtype)(
                grid_1d(x3.size), (BLOCK,), (y3, ones, 0 * ones, c, hw, i64(x3.size), i32(1),
                                             f64(activation), y3))
    if not keep:
        return None
    return XHat(x_hat_out if x_hat_out is not None else x3, params, int(x_hat_out is not None))


def output_from_x_hat(x_hat, y3, slope, bias, activation):
    xp = get_array_module(y3)
    c, acc = y3.shape[1], _accumulator(y3.dtype)
    a = xp.ones(c, acc) if slope is None else slope.astype(acc)
    b = xp.zeros(c, acc) if bias is None else bias.astype(acc)
    if y3.size:
        _kernel('fused_affine_relu', y3.dtype)(
            grid_1d(y3.size), (BLOCK,), (x_hat.source, a, b, i64(c), i64(y3.shape[2]),
                                         i64(y3.size), i32(activation is not None),
                                         f64(activation or 0), y3))


def x_hat_from_output(y3, gamma, beta, activation):
    xp = get_array_module(y3)
    c = y3.shape[1]
    gamma = xp.ones(c, y3.dtype) if gamma is None else gamma.astype(y3.dtype)
    beta = xp.zeros(c, y3.dtype) if beta is None else beta.astype(y3.dtype)
    return FromOutput(contiguous(xp, y3), gamma, beta, 1.0 if activation is None else activation)


def activation_gradient(y3, dy3, activation, x_hat):
    if activation is None or isinstance(x_hat, FromOutput):    # its kernels take it in
        return dy3
    xp = get_array_module(dy3)
    y3, dy3 = contiguous(xp, y3), contiguous(xp, dy3)
    if dy3.size:     # the ReLU's gradient from its output: Eltwise's kernel, one coefficient of 1
        _kernel('fused_eltwise_sum_relu_backward', dy3.dtype, 'eltwise')(
            grid_1d(dy3.size), (BLOCK,), (y3, dy3, f64(1), i64(dy3.size), f64(activation), dy3))
    return dy3


def gradient_sums(dy3, x_hat):
    xp = get_array_module(dy3)
    if x_hat is None:
        return dy3.sum(axis=(0, 2), dtype=STAT), None
    dy3 = contiguous(xp, dy3)
    n, c, hw = dy3.shape
    sums = xp.zeros(2 * c, STAT)
    if n * hw:
        splits = _splits(dy3)
        partial = xp.empty(c * splits * 2, STAT)
        if isinstance(x_hat, FromOutput):
            _kernel('fused_bn_relu_backward_reduce', dy3.dtype)(
                (splits, c), (BLOCK,), (x_hat.y3, dy3, x_hat.gamma, x_hat.beta,
                                        f64(x_hat.negative_slope), i32(n), i32(c), i64(hw),
                                        i32(splits), partial))
        else:
            _kernel('syncbn_backward_reduce', dy3.dtype)(
                (splits, c), (BLOCK,), (x_hat.source, dy3, x_hat.params, i32(x_hat.is_x_hat),
                                        i32(n), i32(c), i64(hw), i32(splits), partial))
        _kernel('syncbn_grad_finish', dy3.dtype)(
            grid_channels(c), (BLOCK,), (partial, i32(splits), i32(c), sums, None, None))
    return sums[:c], sums[c:]


def input_gradient(dx3, dy3, scale, x_hat=None, sum_dy=None, sum_dy_x_hat=None, count=None):
    xp = get_array_module(dy3)
    dy3 = contiguous(xp, dy3)
    c = dy3.shape[1]
    if isinstance(x_hat, FromOutput):
        params = xp.zeros(5 * c, _accumulator(dy3.dtype))
        params[3 * c:4 * c] = scale            # gamma * inv_std, the factor of g in dx
        if sum_dy is None:                     # dx = scale * g: no batch terms
            sums, count = xp.zeros(2 * c, STAT), xp.ones(1, STAT)
        else:
            sums = xp.concatenate([sum_dy, sum_dy_x_hat]).astype(STAT)
        if dy3.size:
            _kernel('fused_bn_relu_backward_dx', dy3.dtype)(
                grid_1d(dy3.size), (BLOCK,),
                (x_hat.y3, dy3, x_hat.gamma, x_hat.beta, f64(x_hat.negative_slope), params, sums,
                 count, i64(c), i64(dy3.shape[2]), i64(dy3.size), dx3))
        return
    if x_hat is None:
        source, is_x_hat, params = dy3, 0, xp.zeros(5 * c, _accumulator(dy3.dtype))
    else:
        source, is_x_hat, params = x_hat.source, x_hat.is_x_hat, x_hat.params.copy()
    params[3 * c:4 * c] = scale            # the factor of dy in dx
    sums = None if sum_dy is None else xp.concatenate([sum_dy, sum_dy_x_hat]).astype(STAT)
    if dy3.size:
        _kernel('syncbn_backward_dx', dy3.dtype)(
            grid_1d(dy3.size // vector_width(dy3.dtype) or 1), (BLOCK,),
            (source, dy3, dx3, params, i32(is_x_hat), sums,
             count, i64(c), i64(dy3.shape[2]), i64(dy3.size)))
