"""The layer kernels of cuda/ on a real GPU, against the CPU layers (the geometries the
emulated kernels run in tests/layers, helpers/layer_cases.py), plus the same-device
reduction. The layer tests of tests/layers run on the GPU too (their engine fixture)."""
import numpy as np
import pytest
from gpu_support import require_gpu

cupy = require_gpu()
pytestmark = pytest.mark.gpu

from helpers.layer_cases import IM2COL, POOLS  # noqa: E402

from caffe_syncbn.blob import Blob  # noqa: E402
from caffe_syncbn.backend.cuda_runtime import launch_copy, launch_sum  # noqa: E402
from caffe_syncbn.layer import TRAIN, LayerContext, create_layer  # noqa: E402
from caffe_syncbn.layers.conv import array as cpu_im2col, gpu as im2col_gpu  # noqa: E402
from caffe_syncbn.layers.interp import gpu as interp_gpu  # noqa: E402
from caffe_syncbn.layers.loss import gpu as softmax_loss_gpu  # noqa: E402
from caffe_syncbn.layers.lrn import gpu as lrn_gpu  # noqa: E402
from caffe_syncbn.layers.pooling import gpu as pooling_gpu  # noqa: E402
from caffe_syncbn.layers.pooling.array import Pool2d  # noqa: E402
from caffe_syncbn.testing import build_layer, layer_param  # noqa: E402

TOL = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 1e-2}


def close(actual, expected, dtype, what=''):
    np.testing.assert_allclose(cupy.asnumpy(actual).astype(np.float64),
                               np.asarray(expected, np.float64), rtol=TOL[dtype],
                               atol=TOL[dtype], err_msg=what)


@pytest.mark.parametrize('kernel,pad,stride,dilation,spatial', IM2COL)
@pytest.mark.parametrize('dtype', [np.float32, np.float64, np.float16])
def test_im2col(kernel, pad, stride, dilation, spatial, dtype):
    x = np.random.RandomState(0).standard_normal((2, 3) + spatial).astype(dtype)
    col = im2col_gpu.im2col(cupy.asarray(x), kernel, pad, stride, dilation)
    np.testing.assert_array_equal(cupy.asnumpy(col), cpu_im2col.im2col(x, kernel, pad, stride, dilation))
    g = np.random.RandomState(1).standard_normal(col.shape).astype(dtype)
    close(im2col_gpu.col2im(cupy.asarray(g), spatial, kernel, pad, stride, dilation),
          cpu_im2col.col2im(g, spatial, kernel, pad, stride, dilation), dtype)


@pytest.mark.parametrize('method,in_hw,kernel,stride,pad,ceil', POOLS)
def test_pooling(method, in_hw, kernel, stride, pad, ceil):
    x = np.random.RandomState(2).standard_normal((2, 3) + in_hw).astype(np.float32)
    cpu_pool = Pool2d(method, in_hw, kernel, stride, pad, ceil, ValueError)
    gpu_pool = Pool2d(method, in_hw, kernel, stride, pad, ceil, ValueError)
    y = cupy.empty(x.shape[:2] + gpu_pool.out_hw, np.float32)
    pooling_gpu.forward(gpu_pool, cupy.asarray(x), TRAIN, None, y)
    close(y, cpu_pool.forward(x, TRAIN, None), np.float32)
    if method == 'MAX':
        np.testing.assert_array_equal(cupy.asnumpy(pooling_gpu.mask(gpu_pool)), cpu_pool.index)
    dy = np.random.RandomState(3).standard_normal(y.shape).astype(np.float32)
    dx = cupy.empty(x.shape, np.float32)
    pooling_gpu.backward(gpu_pool, cupy.asarray(dy), TRAIN, dx)
    close(dx, cpu_pool.backward(dy, TRAIN), np.float32)


def gpu_layer(text, arrays, dtype):
    """The layer of ``text`` on CuPy blobs holding ``arrays`` (as testing.build_layer)."""
    layer = create_layer(layer_param(text), LayerContext(phase=TRAIN, xp=cupy, dtype=dtype))
    bottom = []
    for a in arrays:
        blob = Blob(np.shape(a), dtype, cupy)
        blob.data[...] = cupy.asarray(a, dtype)
        bottom.append(blob)
    top = [Blob((), dtype, cupy) for _ in layer.param.top]
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    return layer, bottom, top


def run(layer, bottom, top, forward, backward, top_diff):
    xp = bottom[0].xp
    forward(layer, bottom, top) if forward else layer.forward(bottom, top)
    out = [top[0].data.copy()]
    top[0].diff[...] = xp.asarray(top_diff)
    backward(layer, top, [True, False], bottom) if backward else \
        layer.backward(top, [True, False], bottom)
    return out + [bottom[0].diff.copy()]


@pytest.mark.parametrize('extra', ['', 'loss_param { ignore_label: 2 }'])
def test_softmax_with_loss(extra):
    rs = np.random.RandomState(4)
    scores, labels = rs.standard_normal((2, 5, 8, 8)) * 3, rs.randint(0, 5, (2, 1, 8, 8)).astype(float)
    text = 'name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss" ' + extra
    want = run(*build_layer(text, [scores, labels], dtype=np.float32), None, None, 1.5)
    got = run(*gpu_layer(text, [scores, labels], np.float32), softmax_loss_gpu.forward,
              softmax_loss_gpu.backward, 1.5)
    for a, b in zip(got, want):
        close(a, b, np.float32)


@pytest.mark.parametrize('param', ['zoom_factor: 3', 'shrink_factor: 2 pad_beg: -1 pad_end: -1'])
def test_interp(param):
    rs = np.random.RandomState(5)
    x = rs.standard_normal((2, 3, 9, 7))
    text = 'name: "i" type: "Interp" bottom: "x" top: "y" interp_param { %s }' % param
    layer, bottom, top = build_layer(text, [x], dtype=np.float32)
    dy = rs.standard_normal(top[0].shape)
    want = run(layer, bottom, top, None, None, dy)
    got = run(*gpu_layer(text, [x], np.float32), interp_gpu.forward, interp_gpu.backward, dy)
    for a, b in zip(got, want):
        close(a, b, np.float32)


def test_lrn():
    rs = np.random.RandomState(6)
    x = rs.standard_normal((2, 7, 5, 4))
    text = ('name: "n" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 5 alpha: 0.5 '
            'beta: 0.75 k: 2 }')
    dy = rs.standard_normal(x.shape)
    want = run(*build_layer(text, [x], dtype=np.float32), None, None, dy)
    got = run(*gpu_layer(text, [x], np.float32), lrn_gpu.forward, lrn_gpu.backward, dy)
    for a, b in zip(got, want):
        close(a, b, np.float32)


@pytest.mark.parametrize('count', [1, 4, 9])
def test_reduce_sum_in_rank_order(count):
    arrays = [np.random.RandomState(r).standard_normal(1001).astype(np.float32) * 10.0 ** (r % 4)
              for r in range(count)]
    out = cupy.empty(1001, np.float32)
    launch_sum(out, [cupy.asarray(a) for a in arrays])
    want = arrays[0].copy()
    for a in arrays[1:]:
        want += a
    np.testing.assert_array_equal(cupy.asnumpy(out), want)
    copied = cupy.zeros_like(out)
    launch_copy(copied, out)
    np.testing.assert_array_equal(cupy.asnumpy(copied), want)
