"""Pooling (MAX, AVE, STOCHASTIC) and SPP: Caffe's golden outputs and every engine against the
float64 array engine (the engine fixture), finite-difference gradients, Caffe's rules for ties,
masks and sizes, the forks' spellings of floor rounding against Caffe's loop, and the host
engine's MAX against the array engine's on 1 to 3 threads. The forks' ROIPooling and Upsample:
test_fork_layers.py."""
import numpy as np
import pytest

from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layer import TEST, TRAIN
from caffe_syncbn.layers.pooling import array as pooling_array, gpu as pooling_gpu, \
    host as pooling_host
from caffe_syncbn.layers.pooling.array import Pool2d
from caffe_syncbn.testing import build_layer
from helpers.arrays import randn
from helpers.cuda_emulation import emulated_kernels
from helpers.engines import assert_matches, reference
from helpers.golden_layer_case import run_single_layer_case, single_layer_cases
from helpers.layer_cases import POOLS
from helpers.layer_checks import forward


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('case', single_layer_cases(['Pooling', 'SPP']))
def test_golden_single_layer(case, dtype, engine, monkeypatch):
    run_single_layer_case(case, monkeypatch, dtype=dtype, engine=engine)


def _distinct(shape, seed=0, scale=0.1):
    """Inputs with no ties, so MAX pooling stays away from its kinks."""
    rs = np.random.RandomState(seed)
    return (rs.permutation(int(np.prod(shape))).reshape(shape) - np.prod(shape) / 2.0) * scale


def _pool(body, tops=('y',)):
    return ('name: "p" type: "Pooling" bottom: "x" %s pooling_param { %s }'
            % (''.join('top: "%s" ' % t for t in tops), body))


# ---------------------------------------------------------------- every engine

@pytest.mark.parametrize('body, shape', [
    ('pool: MAX kernel_size: 3 stride: 2', (2, 2, 6, 7)),
    ('pool: MAX kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 2 pad_h: 1', (1, 2, 5, 4)),
    ('pool: MAX kernel_size: 9 stride: 1', (1, 2, 9, 10)),           # past the host's cells
    ('pool: AVE kernel_size: 3 stride: 2 pad: 1', (2, 2, 6, 6)),
    ('pool: AVE global_pooling: true', (2, 3, 3, 4)),
    ('pool: STOCHASTIC kernel_size: 2 stride: 2', (1, 2, 4, 4)),
    ('pool: MAX kernel_size: 3 stride: 2 pad: 1 ceil_mode: false', (2, 2, 8, 7)),
    ('pool: AVE kernel_size: 3 stride: 2 pad: 1 torch_pooling: true', (2, 2, 8, 7)),
])
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_every_engine_gives_the_float64_array_engine(engine, body, shape, dtype):
    tops = ('y', 'mask') if 'MAX' in body else ('y',)
    text = _pool(body, tops)
    x = [np.abs(_distinct(shape))]          # STOCHASTIC pooling takes non-negative inputs
    assert_matches(engine.run(text, x, dtype=dtype), reference(text, x), dtype, engine.name)


@pytest.mark.parametrize('method,in_hw,kernel,stride,pad,ceil', POOLS)
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_cuda_pool2d_passes_equal_the_array_engines(method, in_hw, kernel, stride, pad, ceil,
                                                    dtype, monkeypatch):
    """Pool2d geometries the layer's parameters do not reach, with ties: the first maximum
    wins."""
    emulated_kernels(monkeypatch)
    rs = np.random.RandomState(1)
    x = rs.standard_normal((2, 2) + in_hw).astype(dtype)
    x[0, 0, :2, :2] = 1.5
    pools = [Pool2d(method, in_hw, kernel, stride, pad, ceil, ValueError) for _ in range(2)]
    ys = [np.empty(x.shape[:2] + pools[0].out_hw, dtype) for _ in pools]
    for engine, pool, y in zip((pooling_array, pooling_gpu), pools, ys):
        engine.forward(pool, x, TRAIN, None, y)
    np.testing.assert_allclose(ys[1], ys[0], rtol=1e-5, atol=1e-5)
    if method == 'MAX':
        np.testing.assert_array_equal(pooling_gpu.mask(pools[1]), pooling_array.mask(pools[0]))
    dy = rs.standard_normal(ys[0].shape).astype(dtype)
    dxs = [np.empty_like(x) for _ in pools]
    for engine, pool, dx in zip((pooling_array, pooling_gpu), pools, dxs):
        engine.backward(pool, dy, TRAIN, dx)
    np.testing.assert_allclose(dxs[1], dxs[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the layers

@pytest.mark.parametrize('body, shape', [
    ('pool: MAX kernel_size: 3 stride: 2', (2, 2, 6, 7)),
    ('pool: MAX kernel_size: 2 stride: 2 pad: 1', (1, 2, 5, 5)),
    ('pool: MAX kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 2 pad_h: 1', (1, 2, 5, 4)),
    ('pool: MAX kernel_size: 2 stride: 3', (1, 2, 7, 7)),
    ('pool: MAX global_pooling: true', (2, 3, 3, 4)),
    ('pool: AVE kernel_size: 3 stride: 2 pad: 1', (2, 2, 6, 6)),
    ('pool: AVE kernel_size: 3 stride: 2', (1, 2, 6, 8)),
    ('pool: AVE kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1', (1, 2, 5, 4)),
    ('pool: AVE global_pooling: true', (2, 3, 3, 4)),
    ('pool: AVE kernel_size: 3 stride: 2 round_mode: FLOOR', (1, 2, 6, 8)),
])
def test_pooling_gradient(host_engine, body, shape):
    host_engine.check_gradient(_pool(body), [_distinct(shape)])


def pooling_reference(x, method, kernel, stride, pad, round_up):
    """Caffe's pooling loop (BVLC, and the forks' floor rounding of pull request 3057 and
    Facebook's torch_pooling): the pooled size rounded up or down, less a last window that
    would start in the padding; AVE divides by the window clipped to the padded input."""
    n, c, h, w = x.shape
    sizes = []
    for size in (h, w):
        span = size + 2 * pad - kernel
        out = (int(np.ceil(span / stride)) if round_up else span // stride) + 1
        if pad and (out - 1) * stride >= size + pad:
            out -= 1
        sizes.append(out)
    y = np.zeros((n, c) + tuple(sizes))
    for i, j, ph, pw in np.ndindex(*y.shape):
        hstart, wstart = ph * stride - pad, pw * stride - pad
        hend, wend = min(hstart + kernel, h + pad), min(wstart + kernel, w + pad)
        area = (hend - hstart) * (wend - wstart)
        hstart, wstart, hend, wend = max(hstart, 0), max(wstart, 0), min(hend, h), min(wend, w)
        window = x[i, j, hstart:hend, wstart:wend]
        y[i, j, ph, pw] = window.max() if method == 'MAX' else window.sum() / area
    return y


FLOOR_SPELLINGS = ['round_mode: FLOOR', 'ceil_mode: false', 'torch_pooling: true']


@pytest.mark.parametrize('method', ['MAX', 'AVE'])
@pytest.mark.parametrize('spelling', FLOOR_SPELLINGS + ['ceil_mode: true', 'round_mode: CEIL'])
@pytest.mark.parametrize('kernel, stride, pad, in_hw', [
    (3, 2, 0, (8, 7)), (3, 2, 1, (8, 7)), (2, 2, 1, (5, 6)), (3, 3, 1, (10, 11))])
def test_each_forks_rounding_gives_its_loop(method, spelling, kernel, stride, pad, in_hw):
    x = randn(2, 2, *in_hw)
    body = 'pool: %s kernel_size: %d stride: %d pad: %d %s' % (method, kernel, stride, pad,
                                                               spelling)
    _, _, top = forward(_pool(body), [x])
    expected = pooling_reference(x, method, kernel, stride, pad, spelling not in FLOOR_SPELLINGS)
    assert top[0].shape == expected.shape
    np.testing.assert_allclose(top[0].data, expected, rtol=1e-13, atol=1e-15)


def test_floor_rounding_drops_the_last_partial_window():
    """A 8-wide input, kernel 3, stride 2: Caffe's ceil gives 4 windows (the last overhangs),
    every floor spelling gives 3, as PyTorch's MaxPool2d does."""
    for spelling, width in [('', 4)] + [(s, 3) for s in FLOOR_SPELLINGS]:
        _, _, top = forward(_pool('pool: MAX kernel_size: 3 stride: 2 ' + spelling),
                             [randn(1, 1, 8, 8)])
        assert top[0].shape == (1, 1, width, width), spelling


def test_contradicting_roundings_are_one_error_line():
    with pytest.raises(CaffeError) as info:
        forward(_pool('pool: MAX kernel_size: 3 stride: 2 ceil_mode: false round_mode: CEIL'),
                 [randn(1, 1, 8, 8)])
    assert "'p' (type Pooling)" in str(info.value) and '\n' not in str(info.value)
    assert 'pooling_param rounds both ways: ceil_mode: false, round_mode: CEIL' in str(info.value)


def test_max_pooling_ties_and_mask():
    """On ties the first maximum in row-major order wins, as in Caffe."""
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 1, 0] = x[0, 0, 0, 1] = 5    # both in the first 2x2 window: (0, 1) comes first
    layer, bottom, top = forward(_pool('pool: MAX kernel_size: 2 stride: 2', ('y', 'mask')), [x])
    assert top[1].data[0, 0, 0, 0] == 1           # h * W + w of (0, 1)
    assert top[1].data[0, 0, 1, 1] == 2 * 4 + 2   # all zeros: the window's first cell
    top[0].diff[...] = 1
    layer.backward(top, [True, False], bottom)
    assert bottom[0].diff[0, 0, 0, 1] == 1 and bottom[0].diff[0, 0, 1, 0] == 0


def test_overlapping_max_pooling_adds_gradients_of_shared_maxima():
    x = np.zeros((1, 1, 3, 3))
    x[0, 0, 1, 1] = 1
    layer, bottom, top = forward(_pool('pool: MAX kernel_size: 2 stride: 1'), [x])
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    assert bottom[0].diff[0, 0, 1, 1] == 4


def test_stochastic_pooling():
    x = np.abs(_distinct((2, 2, 5, 5))) + 0.1
    body = 'pool: STOCHASTIC kernel_size: 3 stride: 2'
    _, _, top = forward(_pool(body), [x], phase=TEST)
    window = x[0, 1, 2:5, 0:3]
    np.testing.assert_allclose(top[0].data[0, 1, 1, 0], np.sum(window ** 2) / np.sum(window))
    layer, bottom, top = forward(_pool(body), [x], phase=TRAIN)
    assert top[0].data[0, 1, 1, 0] in window        # a sampled cell of its window
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    assert bottom[0].diff.sum() == top[0].count
    assert set(np.unique(bottom[0].diff)) <= {0, 1, 2, 3, 4}
    test_layer, bottom, top = forward(_pool(body), [x], phase=TEST)
    with pytest.raises(CaffeError, match='TEST'):
        test_layer.backward(top, [True], bottom)


@pytest.mark.parametrize('body, message', [
    ('pool: MAX kernel_size: 2 pad: 2', 'smaller than the kernel'),
    ('pool: AVE global_pooling: true kernel_size: 2', 'global_pooling'),
    ('pool: STOCHASTIC kernel_size: 3 pad: 1', 'MAX and AVE'),
    ('pool: MAX', 'kernel_size'),
])
def test_pooling_errors(body, message):
    with pytest.raises(CaffeError, match=message):
        build_layer(_pool(body), [randn(1, 1, 5, 5)])


def test_pooling_mask_top_only_for_max():
    with pytest.raises(CaffeError, match='top'):
        build_layer(_pool('pool: AVE kernel_size: 2', ('y', 'mask')), [randn(1, 1, 4, 4)])


@pytest.mark.parametrize('body, shape, out', [
    ('pyramid_height: 3 pool: MAX', (2, 2, 7, 7), (2, 42)),
    ('pyramid_height: 2 pool: AVE', (1, 2, 6, 9), (1, 10)),
    ('pyramid_height: 1 pool: MAX', (1, 2, 3, 4), (1, 2, 1, 1)),
])
def test_spp(host_engine, body, shape, out):
    text = 'name: "s" type: "SPP" bottom: "x" top: "y" spp_param { %s }' % body
    _, _, top = forward(text, [_distinct(shape)])
    assert top[0].shape == out
    host_engine.check_gradient(text, [_distinct(shape)])


# ---------------------------------------------------------------- the host engine

@pytest.mark.parametrize('body, shape', [
    ('kernel_size: 2 stride: 2', (2, 3, 8, 6)),
    ('kernel_size: 3 stride: 2', (2, 3, 9, 7)),                      # overlapping, ceil
    ('kernel_size: 3 stride: 2 pad: 1', (1, 2, 6, 5)),
    ('kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_w: 1', (2, 2, 5, 6)),
    ('kernel_size: 2 stride: 3', (1, 2, 7, 7)),                      # gaps between windows
    ('kernel_size: 3 stride: 1 pad: 2', (1, 1, 4, 4)),
])
@pytest.mark.parametrize('ties', [False, True])
def test_host_max_pooling_matches_the_array_path(body, shape, ties, threads, monkeypatch):
    x = np.round(randn(*shape)) if ties else randn(*shape)       # ties: many equal values
    text = ('name: "p" type: "Pooling" bottom: "x" top: "y" top: "mask" pooling_param { '
            'pool: MAX %s }' % body)
    results = []
    for cells in (64, 0):             # the host path, then the separable array code
        monkeypatch.setattr(pooling_host, 'MAX_CELLS', cells)
        layer, bottom, top = build_layer(text, [x])
        layer.forward(bottom, top)
        top[0].diff[...] = randn(*top[0].shape, seed=5)
        layer.backward(top, [True], bottom)
        results.append([top[0].data.copy(), top[1].data.copy(), bottom[0].diff.copy()])
    (y, mask, dx), (y_ref, mask_ref, dx_ref) = results
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(mask, mask_ref)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-14, atol=1e-14)   # overlaps add in order


@pytest.mark.parametrize('shape', [(1, 64, 8, 8), (3, 5, 7, 9), (2, 3, 1, 6)])
def test_global_average_pooling_adds_in_the_order_of_the_window_sums(shape):
    """The whole-input window's few calls give the bits of the separable window sums,
    in float32, where a different order of additions would show."""
    pool = Pool2d('AVE', shape[2:], shape[2:], (1, 1), (0, 0), True, ValueError)
    assert pool.whole
    x = (randn(*shape) * 10).astype(np.float32)
    dy = randn(shape[0], shape[1], 1, 1, seed=3).astype(np.float32)
    y, dx = pool.forward(x, 0, None), pool.backward(dy, 0).copy()
    pool.whole = False
    np.testing.assert_array_equal(y, pool.forward(x, 0, None))
    np.testing.assert_array_equal(dx, pool.backward(dy, 0))
