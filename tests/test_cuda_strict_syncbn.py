"""The SyncBN kernels of cuda/norm.cu, launched directly through the strict emulation
(tests/helpers/cuda_emulation.py) with grids and blocks chosen here, against float64 numpy:
odd sizes (C=3, N*HW=1, HW=257), blocks of 32, 96 and 256 (the reductions' __launch_bounds__) or 1024,
grids smaller than the work, pointers one element off 16-byte alignment (the scalar paths),
float16/32/64, and every schedule order that can change a result."""
import numpy as np
import pytest

from helpers.cuda_emulation import kernel, schedule

SUFFIX = {np.float16: 'f16', np.float32: 'f32', np.float64: 'f64'}
ACC = {np.float16: np.float32, np.float32: np.float32, np.float64: np.float64}
#: relative error of a sum in the accumulation type / of a value rounded to the storage type
SUM_TOL = {np.float16: 1e-5, np.float32: 1e-5, np.float64: 1e-12}
OUT_TOL = {np.float16: 2e-3, np.float32: 2e-5, np.float64: 1e-12}
SHAPES = [(2, 3, 257), (1, 3, 1), (3, 5, 16), (2, 3, 64)]


def device(values, dtype, misaligned=False):
    """A contiguous copy of values; misaligned: starting one element past a 16-byte boundary.
    It ends where its allocation ends, so that AddressSanitizer (make kernel-asan) sees a
    read or write one past it."""
    values = np.asarray(values)
    start = 1 if misaligned else 0
    buffer = np.empty(values.size + start, dtype)
    assert buffer[start:].ctypes.data % 16 == (dtype(0).itemsize if misaligned else 0)
    out = buffer[start:start + values.size].reshape(values.shape)
    out[...] = values
    return out


def nan_filled(shape, dtype, misaligned=False):
    return device(np.full(shape, np.nan), dtype, misaligned)


def k(name, dtype):
    return kernel('norm', 'syncbn_%s_%s' % (name, SUFFIX[dtype]))


def assert_close(got, want, tol, what, scale=None):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.maximum(1, np.abs(want)) if scale is None else scale
    err = np.max(np.abs(got - want) / scale, initial=0)
    assert np.isfinite(got).all() and err <= tol, '%s: error %.3g > %.3g' % (what, err, tol)


@pytest.fixture(params=['forward', 'reverse', 'random:7'])
def order(request):
    with schedule(request.param):
        yield request.param


def data(shape, seed, offset=0.0):
    rs = np.random.RandomState(seed)
    return rs.standard_normal(shape) * 2 + offset


@pytest.mark.parametrize('dtype', [np.float16, np.float32, np.float64])
@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('block, splits, misaligned', [(256, 1, False), (96, 3, True),
                                                       (32, 2, False)])
def test_local_stats(order, dtype, shape, block, splits, misaligned):
    n, c, hw = shape
    x = device(data(shape, 0, offset=40), dtype, misaligned)
    partial = np.full(c * splits * 2, np.nan)
    pivot = np.full(c, np.nan)
    k('local_stats', dtype)((splits, c), (block,), (x, np.int32(n), np.int32(c), np.int64(hw),
                                                   np.int32(splits), partial, pivot))
    x64 = x.astype(np.float64)
    p = x64[0, :, 0]
    assert (pivot == p).all()
    d = x64 - p[None, :, None]
    got = partial.reshape(c, splits, 2).sum(1)
    scale1, scale2 = np.abs(d).sum((0, 2)) + 1, (d * d).sum((0, 2)) + 1
    assert_close(got[:, 0], d.sum((0, 2)), SUM_TOL[dtype], 'sum(x-p)', scale1)
    assert_close(got[:, 1], (d * d).sum((0, 2)), SUM_TOL[dtype], 'sum((x-p)^2)', scale2)


@pytest.mark.parametrize('misaligned', [False, True])   # the vector path, the scalar path
def test_float16_sums_run_in_float32(misaligned):
    """128 values per thread: a float16 running sum would be off by far more than float32's."""
    shape, c = (4, 3, 1024), 3
    x = device(data(shape, 40, offset=40), np.float16, misaligned)
    dy = device(data(shape, 41), np.float16, misaligned)
    params, (mean, invstd, _, _) = make_params(c, np.float16, 42)
    partial, pivot = np.full(c * 2, np.nan), np.full(c, np.nan)
    k('local_stats', np.float16)((1, c), (32,), (x, np.int32(4), np.int32(c), np.int64(1024),
                                                 np.int32(1), partial, pivot))
    x64, g = x.astype(np.float64), dy.astype(np.float64)
    d = x64 - x64[0, :, 0][None, :, None]
    got = partial.reshape(c, 2)
    assert_close(got[:, 0], d.sum((0, 2)), 1e-5, 'sum(x-p)', np.abs(d).sum((0, 2)))
    assert_close(got[:, 1], (d * d).sum((0, 2)), 1e-5, 'sum((x-p)^2)', (d * d).sum((0, 2)))
    k('backward_reduce', np.float16)((1, c), (32,), (
        x, dy, params, np.int32(0), np.int32(4), np.int32(c), np.int64(1024), np.int32(1), partial))
    xhat = (x64 - per_channel(mean, shape)) * per_channel(invstd, shape)
    assert_close(got[:, 0], g.sum((0, 2)), 1e-5, 'sum(dy)', np.abs(g).sum((0, 2)))
    assert_close(got[:, 1], (g * xhat).sum((0, 2)), 1e-4, 'sum(dy*xhat)',
                 np.abs(g * xhat).sum((0, 2)))


@pytest.mark.parametrize('dtype', [np.float16, np.float32, np.float64])
@pytest.mark.parametrize('with_shift', [True, False])
def test_stats_finish(dtype, with_shift):
    c, splits, count = 37, 3, 11.0
    rs = np.random.RandomState(1)
    partial = rs.standard_normal(c * splits * 2)
    pivot = rs.standard_normal(c)
    shift = device(rs.standard_normal(c), dtype, misaligned=True) if with_shift else None
    out = np.full(1 + 2 * c, np.nan)
    k('stats_finish', dtype)((2,), (32,), (partial, np.int32(splits), np.int32(c), pivot, shift,
                                          np.float64(count), out))
    s = partial.reshape(c, splits, 2)
    s1, s2 = s[:, :, 0].sum(1), s[:, :, 1].sum(1)
    d = pivot - shift.astype(np.float64) if with_shift else np.zeros(c)
    assert out[0] == count
    assert_close(out[1:1 + c], s1 + count * d, 1e-13, 'sum(x-K)')
    assert_close(out[1 + c:], s2 + 2 * d * s1 + count * d * d, 1e-13, 'sum((x-K)^2)')


def make_params(c, dtype, seed):
    rs = np.random.RandomState(seed)
    mean, invstd = rs.standard_normal(c) + 40, rs.uniform(0.5, 2, c)
    slope, bias = rs.standard_normal(c), rs.standard_normal(c)
    a = ACC[dtype]
    hi = mean.astype(a)
    params = np.concatenate([hi, (mean - hi).astype(a), invstd, slope * invstd, bias]).astype(a)
    p = params.astype(np.float64).reshape(5, c)
    return params, (p[0] + p[1], p[2], p[3], p[4])


def per_channel(v, shape):
    return np.asarray(v)[None, :, None] * np.ones(shape)


#: (grid, block, misaligned x or y, xhat): grids smaller than the work, blocks 32/96/1024
ELEMENTWISE = [((1,), (32,), None), ((2,), (96,), 'x'), ((3,), (1024,), None),
               ((1,), (96,), 'y')]


@pytest.mark.parametrize('dtype', [np.float16, np.float32, np.float64])
@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('grid, block, misaligned', ELEMENTWISE + [((2,), (32,), 'xhat')])
@pytest.mark.parametrize('xhat_out', [True, False])
def test_normalize(dtype, shape, grid, block, misaligned, xhat_out):
    n, c, hw = shape
    params, (mean, invstd, scale, bias) = make_params(c, dtype, 3)
    x = device(data(shape, 4, offset=40), dtype, misaligned == 'x')
    y = nan_filled(shape, dtype, misaligned == 'y')
    xhat = nan_filled(shape, dtype, misaligned == 'xhat') if xhat_out else None
    k('normalize', dtype)(grid, block, (x, y, xhat, params, np.int64(c), np.int64(hw),
                                        np.int64(x.size)))
    x64 = x.astype(np.float64)
    d = x64 - per_channel(mean, shape)
    assert_close(y, d * per_channel(scale, shape) + per_channel(bias, shape), OUT_TOL[dtype], 'y')
    if xhat_out:
        assert_close(xhat, d * per_channel(invstd, shape), OUT_TOL[dtype], 'xhat')


@pytest.mark.parametrize('dtype', [np.float16, np.float32, np.float64])
def test_normalize_in_place(dtype):
    shape = (2, 3, 64)
    params, (mean, _, scale, bias) = make_params(3, dtype, 3)
    x = device(data(shape, 4, offset=40), dtype)
    want = (x.astype(np.float64) - per_channel(mean, shape)) * per_channel(scale, shape) \
        + per_channel(bias, shape)
    k('normalize', dtype)((2,), (32,), (x, x, None, params, np.int64(3), np.int64(64),
                                        np.int64(x.size)))
    assert_close(x, want, OUT_TOL[dtype], 'y in place')


@pytest.mark.parametrize('dtype', [np.float16, np.float32, np.float64])
@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('block, splits, misaligned', [(256, 1, None), (96, 3, 'dy'),
                                                       (32, 2, 'x')])
@pytest.mark.parametrize('x_is_xhat', [0, 1])
def test_backward_reduce(order, dtype, shape, block, splits, misaligned, x_is_xhat):
    n, c, hw = shape
    params, (mean, invstd, _, _) = make_params(c, dtype, 5)
    x = device(data(shape, 6) if x_is_xhat else data(shape, 6, offset=40), dtype, misaligned == 'x')
    dy = device(data(shape, 7), dtype, misaligned == 'dy')
    partial = np.full(c * splits * 2, np.nan)
    k('backward_reduce', dtype)((splits, c), (block,), (
        x, dy, params, np.int32(x_is_xhat), np.int32(n), np.int32(c), np.int64(hw),
        np.int32(splits), partial))
    x64, g = x.astype(np.float64), dy.astype(np.float64)
    xhat = x64 if x_is_xhat else (x64 - per_channel(mean, shape)) * per_channel(invstd, shape)
    got = partial.reshape(c, splits, 2).sum(1)
    assert_close(got[:, 0], g.sum((0, 2)), SUM_TOL[dtype], 'sum(dy)', np.abs(g).sum((0, 2)) + 1)
    assert_close(got[:, 1], (g * xhat).sum((0, 2)), SUM_TOL[dtype] * 10, 'sum(dy*xhat)',
                 np.abs(g * xhat).sum((0, 2)) + 1)


@pytest.mark.parametrize('dtype', [np.float16, np.float32, np.float64])
@pytest.mark.parametrize('param_grads', [True, False])
def test_grad_finish(dtype, param_grads):
    c, splits = 37, 3
    rs = np.random.RandomState(8)
    partial = rs.standard_normal(c * splits * 2)
    out = np.full(2 * c, np.nan)
    d0, b0 = rs.standard_normal(c), rs.standard_normal(c)
    dslope = device(d0, dtype, True) if param_grads else None
    dbias = device(b0, dtype) if param_grads else None
    k('grad_finish', dtype)((2,), (32,), (partial, np.int32(splits), np.int32(c), out, dslope, dbias))
    s = partial.reshape(c, splits, 2).sum(1)
    assert_close(out[:c], s[:, 0], 1e-14, 'sum(dy)')
    assert_close(out[c:], s[:, 1], 1e-14, 'sum(dy*xhat)')
    if param_grads:
        assert_close(dbias, b0.astype(dtype).astype(np.float64) + s[:, 0], OUT_TOL[dtype], 'dbias')
        assert_close(dslope, d0.astype(dtype).astype(np.float64) + s[:, 1], OUT_TOL[dtype], 'dslope')


@pytest.mark.parametrize('dtype', [np.float16, np.float32, np.float64])
@pytest.mark.parametrize('shape', SHAPES)
@pytest.mark.parametrize('grid, block, misaligned', [((1,), (32,), None), ((2,), (96,), 'dy'),
                                                     ((3,), (1024,), 'dx'), ((1,), (96,), 'x')])
@pytest.mark.parametrize('x_is_xhat, batch', [(0, True), (1, True), (0, False)])
def test_backward_dx(dtype, shape, grid, block, misaligned, x_is_xhat, batch):
    n, c, hw = shape
    params, (mean, invstd, scale, _) = make_params(c, dtype, 9)
    x = device(data(shape, 10) if x_is_xhat else data(shape, 10, offset=40), dtype,
               misaligned == 'x')
    dy = device(data(shape, 11), dtype, misaligned == 'dy')
    dx = nan_filled(shape, dtype, misaligned == 'dx')
    rs = np.random.RandomState(12)
    sums = rs.standard_normal(2 * c) * 5 if batch else None
    count = np.array([float(n * hw)])
    k('backward_dx', dtype)(grid, block, (x, dy, dx, params, np.int32(x_is_xhat), sums, count,
                                          np.int64(c), np.int64(hw), np.int64(x.size)))
    x64, g = x.astype(np.float64), dy.astype(np.float64)
    xhat = x64 if x_is_xhat else (x64 - per_channel(mean, shape)) * per_channel(invstd, shape)
    if batch:
        m = max(count[0], 1)
        want = per_channel(scale, shape) * (g - per_channel(sums[:c] / m, shape)
                                            - xhat * per_channel(sums[c:] / m, shape))
    else:
        want = per_channel(scale, shape) * g
    assert_close(dx, want, OUT_TOL[dtype] * 4, 'dx')


@pytest.mark.parametrize('dtype', [np.float16, np.float32, np.float64])
def test_backward_dx_in_place(dtype):
    shape = (2, 3, 64)
    params, (_, _, scale, _) = make_params(3, dtype, 9)
    x = device(data(shape, 10, offset=40), dtype)
    dy = device(data(shape, 11), dtype)
    want = per_channel(scale, shape) * dy.astype(np.float64)
    k('backward_dx', dtype)((2,), (32,), (x, dy, dy, params, np.int32(0), None,
                                          np.array([128.0]), np.int64(3), np.int64(64),
                                          np.int64(x.size)))
    assert_close(dy, want, OUT_TOL[dtype], 'dx in place')
