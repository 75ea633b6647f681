"""LRN's CUDA engine (cuda/lrn.cu), across channels, with the array engine's signatures
(array.py); WITHIN_CHANNEL stays on the array engine."""
from ...backend import cuda_kernels
from ...backend.launch import BLOCK, contiguous, f64, grid_1d, i32, i64


def _columns(shape):
    n, c = shape[:2]
    hw = 1
    for s in shape[2:]:
        hw *= s
    return n, c, hw


def forward(layer, bottom, top):
    xp = layer.xp
    x = contiguous(xp, bottom[0].data)
    n, c, hw = _columns(x.shape)
    layer.scale = xp.empty_like(x)
    y = xp.empty_like(x)
    if x.size:
        cuda_kernels.typed_kernel('lrn', 'lrn_across_forward', x.dtype)(
            grid_1d(n * hw), (BLOCK,),
            (x, i32(n), i32(c), i64(hw), i32(layer.size), f64(layer.alpha / layer.cells),
             f64(layer.beta), f64(layer.k), layer.scale, y))
    top[0].data[...] = y


def backward(layer, top, propagate_down, bottom):
    if not propagate_down[0]:
        return
    xp = layer.xp
    x, y = contiguous(xp, bottom[0].data), contiguous(xp, top[0].data)
    dy = contiguous(xp, top[0].diff)
    n, c, hw = _columns(x.shape)
    dx = xp.empty_like(x)
    if x.size:
        cuda_kernels.typed_kernel('lrn', 'lrn_across_backward', x.dtype)(
            grid_1d(n * hw), (BLOCK,),
            (x, y, layer.scale, dy, i32(n), i32(c), i64(hw), i32(layer.size),
             f64(2 * layer.alpha * layer.beta / layer.cells), f64(layer.beta), dx))
    bottom[0].diff[...] = dx
