"""The fused kernels of cuda/norm.cu (BatchNorm + Scale + ReLU for inference and TRAIN) and
cuda/eltwise.cu (Eltwise SUM + ReLU), launched directly through the strict emulation against
float64 numpy: odd sizes, small grids, blocks of 32, 96, 256 and 1024, misaligned pointers,
float16/32/64, and the reduction in three schedule orders."""
import numpy as np
import pytest

from helpers.cuda_emulation import kernel
from test_cuda_strict_syncbn import (ACC, ELEMENTWISE, OUT_TOL, SHAPES, SUFFIX, SUM_TOL,
                                     assert_close, data, device, make_params, nan_filled,
                                     per_channel)
from test_cuda_strict_syncbn import order  # noqa: F401  (the schedule-order fixture)

DTYPES = [np.float16, np.float32, np.float64]
SLOPES = [0.0, 0.1]


def k(name, dtype):
    stem = 'eltwise' if name.startswith('eltwise') else 'norm'
    return kernel(stem, 'fused_%s_%s' % (name, SUFFIX[dtype]))


def relu(v, slope):
    return np.where(v > 0, v, v * slope)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('grid, block, misaligned', ELEMENTWISE)
@pytest.mark.parametrize('use_relu, slope', [(1, 0.0), (1, 0.1), (0, 0.0)])
def test_affine_relu(dtype, shape, grid, block, misaligned, use_relu, slope):
    n, c, hw = shape
    rs = np.random.RandomState(20)
    a, b = rs.standard_normal(c).astype(ACC[dtype]), rs.standard_normal(c).astype(ACC[dtype])
    x = device(data(shape, 21), dtype, misaligned == 'x')
    y = nan_filled(shape, dtype, misaligned == 'y')
    k('affine_relu', dtype)(grid, block, (x, a, b, np.int64(c), np.int64(hw), np.int64(x.size),
                                          np.int32(use_relu), np.float64(slope), y))
    v = per_channel(a.astype(np.float64), shape) * x.astype(np.float64) + per_channel(b, shape)
    assert_close(y, relu(v, slope) if use_relu else v, OUT_TOL[dtype], 'y')


@pytest.mark.parametrize('dtype', DTYPES)
def test_affine_relu_in_place(dtype):
    shape = (2, 3, 64)
    a, b = np.array([1, -2, 0.5], ACC[dtype]), np.array([0.5, 0, -1], ACC[dtype])
    x = device(data(shape, 22), dtype)
    want = relu(per_channel(a, shape) * x.astype(np.float64) + per_channel(b, shape), 0)
    k('affine_relu', dtype)((2,), (32,), (x, a, b, np.int64(3), np.int64(64), np.int64(x.size),
                                          np.int32(1), np.float64(0), x))
    assert_close(x, want, OUT_TOL[dtype], 'y in place')


def bn_relu(shape, dtype, slope, seed, misaligned=None):
    """x, y = fused forward, and the float64 truth (pre-activation, xhat, gamma, beta)."""
    n, c, hw = shape
    params, (mean, invstd, scale, bias) = make_params(c, dtype, seed)
    gamma = device(scale / invstd, dtype)             # the layer's blobs, as stored
    beta = device(bias, dtype)
    params.reshape(5, c)[3] = gamma.astype(np.float64) * invstd
    params.reshape(5, c)[4] = beta.astype(np.float64)
    x = device(data(shape, seed + 1, offset=40), dtype, misaligned == 'x')
    y = nan_filled(shape, dtype, misaligned == 'y')
    return params, gamma, beta, x, y, (mean, invstd)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('grid, block, misaligned', ELEMENTWISE)
@pytest.mark.parametrize('slope', SLOPES)
def test_bn_relu_forward(dtype, shape, grid, block, misaligned, slope):
    n, c, hw = shape
    params, gamma, beta, x, y, (mean, invstd) = bn_relu(shape, dtype, slope, 23, misaligned)
    k('bn_relu_forward', dtype)(grid, block, (x, params, np.int64(c), np.int64(hw),
                                              np.int64(x.size), np.float64(slope), y))
    xhat = (x.astype(np.float64) - per_channel(mean, shape)) * per_channel(invstd, shape)
    g64, b64 = gamma.astype(np.float64), beta.astype(np.float64)
    pre = xhat * per_channel(g64, shape) + per_channel(b64, shape)
    assert_close(y, relu(pre, slope), OUT_TOL[dtype] * 2, 'y')


def from_output(y, dy, gamma, beta, slope, shape):
    """g and x_hat as the backward recovers them, in float64."""
    y, dy = y.astype(np.float64), dy.astype(np.float64)
    on = y > 0
    pre = np.where(on, y, y / slope if slope else 0)
    g64, b64 = gamma.astype(np.float64), beta.astype(np.float64)
    xhat = (pre - per_channel(b64, shape)) / per_channel(g64, shape)
    return np.where(on, dy, dy * slope), xhat


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('block, splits, misaligned', [(256, 1, None), (96, 3, 'dy'), (32, 2, 'y')])
@pytest.mark.parametrize('slope', SLOPES)
def test_bn_relu_backward(order, dtype, shape, block, splits, misaligned, slope):
    n, c, hw = shape
    params, gamma, beta, x, y, (mean, invstd) = bn_relu(shape, dtype, slope, 24, misaligned)
    k('bn_relu_forward', dtype)((2,), (96,), (x, params, np.int64(c), np.int64(hw),
                                              np.int64(x.size), np.float64(slope), y))
    dy = device(data(shape, 26), dtype, misaligned == 'dy')
    partial = np.full(c * splits * 2, np.nan)
    k('bn_relu_backward_reduce', dtype)((splits, c), (block,), (
        y, dy, gamma, beta, np.float64(slope), np.int32(n), np.int32(c), np.int64(hw),
        np.int32(splits), partial))
    g, xhat = from_output(y, dy, gamma, beta, slope, shape)
    got = partial.reshape(c, splits, 2).sum(1)
    want = g.sum((0, 2)), (g * xhat).sum((0, 2))
    assert_close(got[:, 0], want[0], SUM_TOL[dtype], 'sum(g)', np.abs(g).sum((0, 2)) + 1)
    assert_close(got[:, 1], want[1], SUM_TOL[dtype] * 10, 'sum(g*xhat)',
                 np.abs(g * xhat).sum((0, 2)) + 1)
    if dtype == np.float64:   # what y recovers is the truth: xhat from x, the mask from pre
        true_xhat = (x - per_channel(mean, shape)) * per_channel(invstd, shape)
        pre = true_xhat * per_channel(gamma, shape) + per_channel(beta, shape)
        on = pre > 0
        assert_close(np.where(on | (slope != 0), xhat, 0), np.where(on | (slope != 0), true_xhat, 0),
                     1e-9, 'recovered xhat')
    sums = np.concatenate(want)
    count = np.array([float(n * hw)])
    dx = nan_filled(shape, dtype, misaligned == 'y')
    k('bn_relu_backward_dx', dtype)((2,), (block,), (
        y, dy, gamma, beta, np.float64(slope), params, sums, count, np.int64(c), np.int64(hw),
        np.int64(x.size), dx))
    m = count[0]
    scale = per_channel(params.reshape(5, c)[3].astype(np.float64), shape)
    want_dx = scale * (g - per_channel(sums[:c] / m, shape) - xhat * per_channel(sums[c:] / m, shape))
    assert_close(dx, want_dx, OUT_TOL[dtype] * 4, 'dx')


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('n', [1, 257, 64])
@pytest.mark.parametrize('grid, block, misaligned', ELEMENTWISE)
@pytest.mark.parametrize('slope', SLOPES)
def test_eltwise_sum_relu(dtype, n, grid, block, misaligned, slope):
    rs = np.random.RandomState(27)
    a = device(rs.standard_normal(n), dtype, misaligned == 'x')
    b = device(rs.standard_normal(n), dtype)
    y = nan_filled(n, dtype, misaligned == 'y')
    k('eltwise_sum_relu', dtype)(grid, block, (a, b, np.float64(1.5), np.float64(-0.5),
                                               np.int64(n), np.float64(slope), y))
    want = relu(1.5 * a.astype(np.float64) - 0.5 * b.astype(np.float64), slope)
    assert_close(y, want, OUT_TOL[dtype], 'y')
    dy = device(rs.standard_normal(n), dtype, misaligned == 'y')
    dx = nan_filled(n, dtype, misaligned == 'x')
    k('eltwise_sum_relu_backward', dtype)(grid, block, (y, dy, np.float64(-0.5), np.int64(n),
                                                        np.float64(slope), dx))
    g = dy.astype(np.float64)
    assert_close(dx, -0.5 * np.where(y.astype(np.float64) > 0, g, g * slope), OUT_TOL[dtype], 'dx')
    in_place = relu(a.astype(np.float64) + b.astype(np.float64), slope)
    k('eltwise_sum_relu', dtype)(grid, block, (a, b, np.float64(1.0), np.float64(1.0),
                                               np.int64(n), np.float64(slope), a))
    assert_close(a, in_place, OUT_TOL[dtype], 'y in place')
