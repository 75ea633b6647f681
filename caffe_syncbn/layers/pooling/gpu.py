"""Pooling's CUDA engine (cuda/pooling.cu), with the array engine's signatures (array.py):
MAX and AVE, whose geometry and Caffe's size and divisor rules come from the Pool2d object;
STOCHASTIC runs on the array engine."""
import numpy as np

from ...backend import cuda_kernels, get_array_module
from ...backend.launch import BLOCK, contiguous, grid_1d, i32
from . import array

_KERNELS = ('MAX', 'AVE')


def _args(pool, nc):
    (h, w), (oh, ow) = pool.in_hw, pool.out_hw
    return tuple(i32(v) for v in (nc, h, w, oh, ow) + tuple(pool.kernel) + tuple(pool.stride)
                 + tuple(pool.pad))


def forward(pool, x, phase, rng, out):
    if pool.method in _KERNELS:
        out[...] = _forward(pool, x)
    else:
        array.forward(pool, x, phase, rng, out)


def mask(pool):
    return pool.index


def backward(pool, dy, phase, out):
    if pool.method in _KERNELS:
        out[...] = _backward(pool, dy)
    else:
        array.backward(pool, dy, phase, out)


def _forward(pool, x):
    """MAX keeps ``pool.index`` (int32 h*W + w) for the mask top and the backward."""
    xp = get_array_module(x)
    x = contiguous(xp, x)
    n, c = x.shape[:2]
    y = xp.empty((n, c) + pool.out_hw, x.dtype)
    if y.size == 0:
        pool.index = xp.zeros(y.shape, np.int32)
        return y
    grid = grid_1d(y.size)
    if pool.method == 'MAX':
        pool.index = xp.empty(y.shape, np.int32)
        cuda_kernels.typed_kernel('pooling', 'pool_max_forward', x.dtype)(
            grid, (BLOCK,), (x,) + _args(pool, n * c) + (y, pool.index))
    else:
        cuda_kernels.typed_kernel('pooling', 'pool_ave_forward', x.dtype)(
            grid, (BLOCK,), (x,) + _args(pool, n * c) + (y,))
    return y


def _backward(pool, dy):
    xp = get_array_module(dy)
    dy = contiguous(xp, dy)
    n, c = dy.shape[:2]
    dx = xp.empty((n, c) + tuple(pool.in_hw), dy.dtype)
    if dx.size == 0:
        return dx
    grid = grid_1d(dx.size)
    if pool.method == 'MAX':
        cuda_kernels.typed_kernel('pooling', 'pool_max_backward', dy.dtype)(
            grid, (BLOCK,), (dy, pool.index) + _args(pool, n * c) + (dx,))
    else:
        cuda_kernels.typed_kernel('pooling', 'pool_ave_backward', dy.dtype)(
            grid, (BLOCK,), (dy,) + _args(pool, n * c) + (dx,))
    return dx
