"""Interp's CUDA engine (cuda/interp.cu): crop and align-corners bilinear resize, forward and
its exact adjoint, with the array engine's signatures (array.py). float16 stays on the array
engine, and a pure crop is the layer's one copy."""
import numpy as np

from ...backend import cuda_kernels
from ...backend.launch import BLOCK, contiguous, grid_1d, i32


def supports(dtype):
    return np.dtype(dtype) in (np.float32, np.float64)


def _args(layer, shape):
    n, c, h, w = shape
    return tuple(i32(v) for v in (n * c, h, w, layer.crop_begin) + tuple(layer.in_hw)
                 + tuple(layer.out_hw))


def forward(layer, bottom, top):
    x = contiguous(layer.xp, bottom[0].data)
    y = layer.xp.empty(top[0].shape, x.dtype)
    if y.size:
        cuda_kernels.typed_kernel('interp', 'interp_forward', x.dtype)(
            grid_1d(y.size), (BLOCK,), (x,) + _args(layer, x.shape) + (y,))
    top[0].data[...] = y


def backward(layer, top, propagate_down, bottom):
    if not propagate_down[0]:
        return
    dy = contiguous(layer.xp, top[0].diff)
    dx = layer.xp.zeros(bottom[0].shape, dy.dtype)      # a new buffer: in place works too
    if dy.size:
        cuda_kernels.typed_kernel('interp', 'interp_backward', dy.dtype)(
            grid_1d(dy.size), (BLOCK,), (dy,) + _args(layer, bottom[0].shape) + (dx,))
    bottom[0].diff[...] = dx
