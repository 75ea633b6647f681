"""Eltwise SUM followed by a ReLU (memory plan 'inplace_abn') on the GPU, cuda/eltwise.cu:
the sum of two bottoms and the ReLU in one pass, and each bottom's gradient through the
ReLU from the output's sign."""
from ...backend import cuda_kernels
from ...backend.launch import BLOCK, contiguous, f64, grid_1d, i64


def sum_relu(xp, a, coeff_a, b, coeff_b, negative_slope, y):
    """y = relu(coeff_a * a + coeff_b * b); y may be a or b."""
    a, b = contiguous(xp, a), contiguous(xp, b)
    if y.size:
        cuda_kernels.typed_kernel('eltwise', 'fused_eltwise_sum_relu', y.dtype)(
            grid_1d(y.size), (BLOCK,), (a, b, f64(coeff_a), f64(coeff_b), i64(y.size),
                                        f64(negative_slope), y))


def sum_relu_backward(xp, y, dy, coeff, negative_slope, dx):
    """dx = coeff * (y > 0 ? dy : negative_slope * dy); dx may be dy."""
    y, dy = contiguous(xp, y), contiguous(xp, dy)
    if dx.size:
        cuda_kernels.typed_kernel('eltwise', 'fused_eltwise_sum_relu_backward', dx.dtype)(
            grid_1d(dx.size), (BLOCK,), (y, dy, f64(coeff), i64(dx.size), f64(negative_slope),
                                         dx))
