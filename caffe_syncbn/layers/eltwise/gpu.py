"""Eltwise SUM's CUDA engine (cuda/eltwise.cu), with the array engine's signatures
(array.py): a SUM of two bottoms with the ReLU it absorbed in one pass, and each bottom's
gradient through that ReLU from the output's sign. A SUM without a ReLU, or of more
bottoms forward, runs on the array engine."""
from ...backend import cuda_kernels
from ...backend.launch import BLOCK, contiguous, f64, grid_1d, i64
from . import array


def sum_forward(layer, bottom, top):
    if layer.relu_slope is None or len(bottom) != 2:
        array.sum_forward(layer, bottom, top)
        return
    xp, y = layer.xp, top[0].data
    a, b = contiguous(xp, bottom[0].data), contiguous(xp, bottom[1].data)
    if y.size:      # y = relu(coeff_a * a + coeff_b * b); y may be a or b
        cuda_kernels.typed_kernel('eltwise', 'fused_eltwise_sum_relu', y.dtype)(
            grid_1d(y.size), (BLOCK,), (a, b, f64(layer.coeff[0]), f64(layer.coeff[1]),
                                        i64(y.size), f64(layer.relu_slope), y))


def sum_backward(layer, top, propagate_down, bottom):
    if layer.relu_slope is None:
        array.sum_backward(layer, top, propagate_down, bottom)
        return
    xp = layer.xp
    y, dy = contiguous(xp, top[0].data.reshape(-1)), contiguous(xp, top[0].diff.reshape(-1))
    for coeff, dx, _ in array.gradient_targets(layer, top, propagate_down, bottom):
        if dx.size:     # dx = coeff * (y > 0 ? dy : negative_slope * dy); dx may be dy
            cuda_kernels.typed_kernel('eltwise', 'fused_eltwise_sum_relu_backward', dx.dtype)(
                grid_1d(dx.size), (BLOCK,), (y, dy, f64(coeff), i64(dx.size),
                                             f64(layer.relu_slope), dx))
