"""The layer kernels of cuda/ (im2col, pooling, softmax loss, interp, LRN) and their wrappers
in caffe_syncbn/layers/*_gpu.py, run on the CPU through the kernel emulation (tests/cuda_emulation.py),
against the CPU layers. Small shapes: the emulation runs every CUDA thread in turn."""
import numpy as np
import pytest
from cuda_emulation import emulated_kernels

from caffe_syncbn.layer import TRAIN
from caffe_syncbn.layers.conv import array as cpu_im2col
from caffe_syncbn.layers.pooling.array import Pool2d
from caffe_syncbn.testing import build_layer

TOL = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 1e-2}


@pytest.fixture(autouse=True)
def _emulated(monkeypatch):
    emulated_kernels(monkeypatch)


def close(actual, expected, dtype, what=''):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=TOL[dtype], atol=TOL[dtype], err_msg=what)


GEOMETRIES = [  # kernel, pad, stride, dilation, spatial
    ((3, 3), (1, 1), (1, 1), (1, 1), (5, 6)),
    ((2, 3), (0, 1), (2, 1), (1, 2), (6, 7)),
    ((3, 2), (2, 0), (3, 2), (2, 1), (7, 5)),
    ((1, 1), (0, 0), (1, 1), (1, 1), (3, 4)),
]


@pytest.mark.parametrize('kernel,pad,stride,dilation,spatial', GEOMETRIES)
@pytest.mark.parametrize('dtype', [np.float32, np.float64, np.float16])
def test_im2col_and_col2im_equal_cpu(kernel, pad, stride, dilation, spatial, dtype):
    from caffe_syncbn.layers.conv import gpu as im2col_gpu
    rs = np.random.RandomState(0)
    x = rs.standard_normal((2, 3) + spatial).astype(dtype)
    col = im2col_gpu.im2col(x, kernel, pad, stride, dilation)
    want = cpu_im2col.im2col(x, kernel, pad, stride, dilation)
    np.testing.assert_array_equal(col, want)
    g = rs.standard_normal(col.shape).astype(dtype)
    close(im2col_gpu.col2im(g, spatial, kernel, pad, stride, dilation),
          cpu_im2col.col2im(g, spatial, kernel, pad, stride, dilation), dtype)


POOLS = [  # method, in_hw, kernel, stride, pad, ceil
    ('MAX', (5, 5), (3, 3), (2, 2), (0, 0), True),
    ('MAX', (6, 7), (3, 2), (2, 2), (1, 1), True),
    ('MAX', (5, 6), (2, 2), (1, 1), (0, 0), True),
    ('AVE', (5, 5), (3, 3), (2, 2), (1, 1), True),
    ('AVE', (7, 6), (3, 3), (3, 2), (0, 1), True),
    ('AVE', (6, 6), (2, 2), (2, 2), (0, 0), False),
]


@pytest.mark.parametrize('method,in_hw,kernel,stride,pad,ceil', POOLS)
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_pooling_equals_cpu(method, in_hw, kernel, stride, pad, ceil, dtype):
    from caffe_syncbn.layers.pooling import gpu as pooling_gpu

    def error(message):
        return ValueError(message)

    rs = np.random.RandomState(1)
    x = rs.standard_normal((2, 2) + in_hw).astype(dtype)
    x[0, 0, :2, :2] = 1.5          # ties: the first maximum wins
    cpu_pool = Pool2d(method, in_hw, kernel, stride, pad, ceil, error)
    gpu_pool = Pool2d(method, in_hw, kernel, stride, pad, ceil, error)
    y = np.empty(x.shape[:2] + gpu_pool.out_hw, dtype)
    pooling_gpu.forward(gpu_pool, x, TRAIN, None, y)
    close(y, cpu_pool.forward(x, TRAIN, None), dtype, 'forward')
    if method == 'MAX':
        np.testing.assert_array_equal(pooling_gpu.mask(gpu_pool), cpu_pool.index)
    dy = rs.standard_normal(y.shape).astype(dtype)
    dx = np.empty_like(x)
    pooling_gpu.backward(gpu_pool, dy, TRAIN, dx)
    close(dx, cpu_pool.backward(dy, TRAIN), dtype, 'backward')


def run(layer, bottom, top, forward, backward, top_diff=None):
    forward(layer, bottom, top) if forward else layer.forward(bottom, top)
    outputs = [t.data.copy() for t in top]
    if top_diff is not None:
        top[0].diff[...] = top_diff
    else:
        top[0].diff[...] = 1.5          # a loss weight
    backward(layer, top, [True, False], bottom) if backward else \
        layer.backward(top, [True, False], bottom)
    return outputs + [bottom[0].diff.copy()]


@pytest.mark.parametrize('extra', ['', 'loss_param { ignore_label: 2 }',
                                   'loss_param { ignore_label: 0 normalization: FULL }',
                                   'loss_param { normalization: BATCH_SIZE }'])
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_softmax_with_loss_equals_cpu(extra, dtype):
    from caffe_syncbn.layers.loss import gpu as softmax_loss_gpu
    rs = np.random.RandomState(2)
    scores = rs.standard_normal((2, 4, 3, 2)) * 3
    labels = rs.randint(0, 4, (2, 1, 3, 2)).astype(np.float64)
    text = 'name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss" ' + extra
    want = run(*build_layer(text, [scores, labels], dtype=dtype), None, None)
    got = run(*build_layer(text, [scores, labels], dtype=dtype),
              softmax_loss_gpu.forward, softmax_loss_gpu.backward)
    for a, b in zip(got, want):
        close(a, b, dtype)


def test_softmax_with_loss_rejects_bad_labels():
    from caffe_syncbn.layers.loss import gpu as softmax_loss_gpu
    text = 'name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss"'
    layer, bottom, top = build_layer(text, [np.zeros((2, 3)), np.array([1.0, 3.0])])
    with pytest.raises(Exception, match='labels must lie in'):
        softmax_loss_gpu.forward(layer, bottom, top)


@pytest.mark.parametrize('param', ['height: 7 width: 5', 'zoom_factor: 2',
                                   'shrink_factor: 2 pad_beg: -1 pad_end: -1', 'height: 1 width: 1'])
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_interp_equals_cpu(param, dtype):
    from caffe_syncbn.layers.interp import gpu as interp_gpu
    rs = np.random.RandomState(3)
    x = rs.standard_normal((2, 2, 4, 5))
    text = 'name: "i" type: "Interp" bottom: "x" top: "y" interp_param { %s }' % param
    layer, bottom, top = build_layer(text, [x], dtype=dtype)
    assert interp_gpu.supports(layer.dtype) and not layer.copy_only
    dy = rs.standard_normal(top[0].shape)
    want = run(layer, bottom, top, None, None, dy)
    layer, bottom, top = build_layer(text, [x], dtype=dtype)
    got = run(layer, bottom, top, interp_gpu.forward, interp_gpu.backward, dy)
    for a, b in zip(got, want):
        close(a, b, dtype)


@pytest.mark.parametrize('size', [1, 3, 5])
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_lrn_across_channels_equals_cpu(size, dtype):
    from caffe_syncbn.layers.lrn import gpu as lrn_gpu
    rs = np.random.RandomState(4)
    x = rs.standard_normal((2, 6, 3, 2))
    text = ('name: "n" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: %d alpha: 0.5 '
            'beta: 0.75 k: 2 }' % size)
    dy = rs.standard_normal(x.shape)
    want = run(*build_layer(text, [x], dtype=dtype), None, None, dy)
    got = run(*build_layer(text, [x], dtype=dtype), lrn_gpu.forward, lrn_gpu.backward, dy)
    for a, b in zip(got, want):
        close(a, b, dtype)
