"""Convolution, Deconvolution and Im2col (N-D, grouped, dilated): Caffe's golden outputs and
every engine against the float64 array engine (the engine fixture), finite-difference
gradients, the corner cases of each layer, the host engine's chunkings and threads, and
im2col / col2im of the CUDA engine against the array engine's. Depthwise passes and
Winograd: test_conv_depthwise.py, test_conv_winograd.py."""
import numpy as np
import pytest

from caffe_syncbn.backend import cpu_threads
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layers.conv import array as conv_array, gpu as conv_gpu, host as conv_host, \
    host_columns as conv_columns, host_gemm as conv_cpu
from caffe_syncbn.layers.conv.array import col2im, im2col
from caffe_syncbn.testing import build_layer
from helpers.arrays import randn
from helpers.cuda_emulation import emulated_kernels
from helpers.engines import assert_matches, reference
from helpers.golden_layer_case import run_single_layer_case, single_layer_cases
from helpers.layer_cases import IM2COL
from helpers.layer_checks import forward

TOL = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 1e-2}


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('case', single_layer_cases(['Convolution', 'Deconvolution', 'Im2col']))
def test_golden_single_layer(case, dtype, engine, monkeypatch):
    run_single_layer_case(case, monkeypatch, dtype=dtype, engine=engine)


def _conv(body, kind='Convolution', bottoms=('x',), tops=('y',)):
    links = ''.join('bottom: "%s" ' % b for b in bottoms) + ''.join('top: "%s" ' % t for t in tops)
    return ('name: "c" type: "%s" %s convolution_param { %s weight_filler { type: "gaussian" '
            'std: 0.5 } bias_filler { type: "uniform" min: -0.5 max: 0.5 } }'
            % (kind, links, body))


# ---------------------------------------------------------------- every engine

@pytest.mark.parametrize('kind, body, shape', [
    ('Convolution', 'num_output: 3 kernel_size: 3 pad: 1', (2, 2, 5, 4)),
    ('Convolution', 'num_output: 4 kernel_size: 3 stride: 2 dilation: 2 pad: 2 group: 2',
     (2, 4, 7, 6)),
    ('Convolution', 'num_output: 4 kernel_size: 3 pad: 1 group: 4', (2, 4, 5, 5)),
    ('Convolution', 'num_output: 3 kernel_size: 1', (2, 3, 3, 4)),
    ('Convolution', 'num_output: 4 kernel_size: 3 pad: 1', (2, 5, 8, 8)),     # Winograd's shape
    ('Convolution', 'num_output: 2 kernel_size: 2 pad: 1 stride: 2', (1, 2, 4, 4, 3)),
    ('Deconvolution', 'num_output: 3 kernel_size: 3 stride: 2 pad: 1', (2, 2, 3, 4)),
    ('Deconvolution', 'num_output: 4 kernel_size: 4 stride: 2 pad: 1 group: 4', (1, 4, 3, 3)),
])
@pytest.mark.parametrize('dtype', [np.float32, np.float16])
def test_every_engine_gives_the_float64_array_engine(engine, kind, body, shape, dtype,
                                                     monkeypatch):
    monkeypatch.setenv('CAFFE_SYNCBN_WINOGRAD', 'on')      # the host runs Winograd where it may
    if dtype == np.float16 and not engine.on_device:
        pytest.skip('float16 convolutions run on GPUs')
    text = _conv(body, kind)
    x = [randn(*shape)]
    assert_matches(engine.run(text, x, dtype=dtype), reference(text, x), dtype, engine.name)


# ---------------------------------------------------------------- convolution

@pytest.mark.parametrize('body, shape', [
    ('num_output: 3 kernel_size: 3 pad: 1', (2, 2, 5, 4)),
    ('num_output: 4 kernel_size: 3 stride: 2 dilation: 2 pad: 2 group: 2', (2, 4, 7, 6)),
    ('num_output: 2 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 '
     'bias_term: false', (1, 2, 5, 5)),
    ('num_output: 3 kernel_size: 1', (2, 3, 3, 4)),
    ('num_output: 2 kernel_size: 1 stride: 2', (2, 3, 5, 4)),
    ('num_output: 2 kernel_size: 3 kernel_size: 2 kernel_size: 2 pad: 1 stride: 1 stride: 2 '
     'stride: 1', (1, 2, 4, 4, 3)),
    ('num_output: 2 kernel_size: 2 axis: 2', (2, 1, 2, 4, 3)),
])
def test_convolution_gradient(host_engine, body, shape):
    host_engine.check_gradient(_conv(body), [randn(*shape)])


def test_convolution_two_bottoms_share_weights(host_engine):
    text = _conv('num_output: 2 kernel_size: 2', bottoms=('a', 'b'), tops=('p', 'q'))
    host_engine.check_gradient(text, [randn(2, 2, 3, 3), randn(2, 2, 3, 3, seed=1)])
    layer, bottom, top = forward(text, [randn(2, 2, 3, 3), randn(2, 2, 3, 3)])
    np.testing.assert_array_equal(top[0].data, top[1].data)


@pytest.mark.parametrize('body, shape', [
    ('num_output: 3 kernel_size: 3 stride: 2 pad: 1', (2, 2, 3, 4)),
    ('num_output: 4 kernel_size: 4 stride: 2 pad: 1 group: 2 dilation: 2', (1, 2, 3, 3)),
    ('num_output: 2 kernel_size: 1 bias_term: false', (2, 3, 2, 3)),
])
def test_deconvolution_gradient(host_engine, body, shape):
    host_engine.check_gradient(_conv(body, 'Deconvolution'), [randn(*shape)])


def test_deconvolution_output_size():
    layer, _, top = forward(_conv('num_output: 2 kernel_size: 4 stride: 2 pad: 1 dilation: 1',
                                   'Deconvolution'), [randn(1, 3, 5, 6)])
    assert top[0].shape == (1, 2, 10, 12)
    assert layer.blobs[0].shape == (3, 2, 4, 4)


def test_deconvolution_is_the_adjoint_of_convolution():
    x, y_diff = randn(2, 4, 5, 5), randn(2, 3, 3, 3, seed=1)
    body = 'num_output: %d kernel_size: 3 stride: 2 pad: 1 group: 1 bias_term: false'
    conv, cb, ct = forward(_conv(body % 3), [x])
    deconv, db, dt = forward(_conv(body % 4, 'Deconvolution'), [y_diff])
    deconv.blobs[0].data[...] = conv.blobs[0].data
    deconv.forward(db, dt)
    # <conv(x), y> == <x, deconv(y)>
    np.testing.assert_allclose(np.sum(ct[0].data * y_diff), np.sum(x * dt[0].data))


@pytest.mark.parametrize('wide', [0, 10 ** 9])
def test_batched_and_folded_gemms_agree(wide, monkeypatch):
    """The GEMMs of the array path (GPUs): per image (wide images) or over the folded batch."""
    monkeypatch.setattr(conv_array, '_WIDE_IMAGE', wide)
    w, x, a = randn(2, 3, 4), randn(3, 2, 4, 5, seed=1), randn(3, 2, 3, 5, seed=2)
    np.testing.assert_allclose(conv_array.grouped_matmul(w, x),
                               np.einsum('gmk,ngkp->ngmp', w, x), rtol=1e-12)
    np.testing.assert_allclose(conv_array.grouped_outer(a, x),
                               np.einsum('ngmp,ngkp->gmk', a, x), rtol=1e-12)


def test_convolution_skips_param_grads_with_lr_mult_zero():
    layer, bottom, top = forward(_conv('num_output: 2 kernel_size: 3'), [randn(1, 2, 4, 4)])
    layer.param_propagate_down = [False, False]
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    assert not layer.blobs[0].diff.any() and not layer.blobs[1].diff.any()
    assert bottom[0].diff.any()


@pytest.mark.parametrize('body, message', [
    ('num_output: 3 kernel_size: 3 group: 2', 'group'),
    ('num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3', 'not both'),
    ('num_output: 2 kernel_h: 3', 'both kernel_h and kernel_w'),
    ('num_output: 2 kernel_size: 3 kernel_size: 3 kernel_size: 3', '1 or 2'),
    ('num_output: 2 kernel_size: 7', 'empty'),
    ('num_output: 2', 'kernel_size'),
])
def test_convolution_errors(body, message):
    with pytest.raises(CaffeError, match=message):
        build_layer(_conv(body), [randn(1, 4, 5, 5)])


# ---------------------------------------------------------------- im2col

def test_im2col_layer_gradient_and_channel_order(host_engine):
    text = ('name: "i" type: "Im2col" bottom: "x" top: "y" '
            'convolution_param { kernel_size: 2 stride: 1 pad: 1 dilation: 2 }')
    host_engine.check_gradient(text, [randn(2, 2, 4, 3)])
    x = randn(1, 2, 3, 3)
    _, _, top = forward(text.replace('dilation: 2', ''), [x])
    # channel (c, kh, kw) at output (i, j) reads x[c, i + kh - 1, j + kw - 1]
    assert top[0].shape == (1, 8, 4, 4)
    assert top[0].data[0, 1 * 4 + 1 * 2 + 0, 2, 3] == x[0, 1, 2, 2]
    assert top[0].data[0, 0, 0, 0] == 0


def test_col2im_is_the_adjoint_of_im2col():
    geometry = dict(kernel=(3, 2, 2), pad=(1, 0, 1), stride=(2, 1, 2), dilation=(1, 2, 1))
    x = randn(2, 3, 5, 6, 4)
    col = im2col(x, **geometry)
    c = randn(*col.shape, seed=3)
    np.testing.assert_allclose(np.sum(col * c), np.sum(x * col2im(c, x.shape[2:], **geometry)))


@pytest.mark.parametrize('kernel,pad,stride,dilation,spatial', IM2COL)
@pytest.mark.parametrize('dtype', [np.float32, np.float64, np.float16])
def test_cuda_im2col_and_col2im_equal_the_array_engines(kernel, pad, stride, dilation, spatial,
                                                        dtype, monkeypatch):
    emulated_kernels(monkeypatch)
    rs = np.random.RandomState(0)
    x = rs.standard_normal((2, 3) + spatial).astype(dtype)
    col = conv_gpu.im2col(x, kernel, pad, stride, dilation)
    np.testing.assert_array_equal(col, im2col(x, kernel, pad, stride, dilation))
    g = rs.standard_normal(col.shape).astype(dtype)
    np.testing.assert_allclose(conv_gpu.col2im(g, spatial, kernel, pad, stride, dilation),
                               col2im(g, spatial, kernel, pad, stride, dilation),
                               rtol=TOL[dtype], atol=TOL[dtype])


# ---------------------------------------------------------------- the host engine

GEOMETRIES = [
    ('num_output: 3 kernel_size: 3 pad: 1', (3, 2, 7, 6)),
    ('num_output: 4 kernel_size: 3 stride: 2 dilation: 2 pad: 2 group: 2', (2, 4, 9, 8)),
    ('num_output: 2 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1', (2, 2, 7, 5)),
    ('num_output: 6 kernel_size: 3 pad: 1 group: 6', (2, 6, 5, 5)),            # depthwise
    ('num_output: 3 kernel_size: 1', (3, 4, 3, 5)),
    ('num_output: 2 kernel_size: 1 stride: 2', (2, 3, 5, 4)),
    ('num_output: 2 kernel_size: 3 kernel_size: 2 kernel_size: 2 pad: 1 stride: 1 stride: 2 '
     'stride: 1', (2, 2, 5, 4, 3)),
    ('num_output: 2 kernel_size: 2 axis: 2', (2, 2, 2, 5, 4)),
    ('num_output: 5 kernel_size: 5 stride: 3', (2, 1, 20, 24)),
    # col2im by the stride's phases (conv_columns.by_phases): AlexNet's first layer, a
    # padded stride 2, a stride along the rows alone, a kernel smaller than the stride
    ('num_output: 4 kernel_size: 11 stride: 4 pad: 2', (2, 3, 27, 23)),
    ('num_output: 3 kernel_size: 3 stride: 2 pad: 1', (2, 2, 9, 10)),
    ('num_output: 2 kernel_size: 3 stride_h: 1 stride_w: 2', (2, 2, 6, 9)),
    ('num_output: 2 kernel_size: 2 stride: 3 pad: 1', (1, 2, 8, 7)),
    # column gradients as large as the padded input (conv_columns.PADDED_COLUMNS)
    ('num_output: 3 kernel_size: 3 pad: 1', (2, 3, 9, 12)),
    ('num_output: 4 kernel_size: 3 dilation: 2 pad: 2', (3, 2, 16, 16)),
    ('num_output: 2 kernel_h: 3 kernel_w: 2 pad_h: 1', (2, 2, 12, 12)),
    ('num_output: 2 kernel_size: 3', (2, 2, 12, 12)),
]


CHUNKINGS = [(1, 16), (2000, 16), (9000, 1), (9000, 10 ** 6), (10 ** 9, 10 ** 6), (10 ** 9, 1)]


def _conv_text(body):
    return ('name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param { %s '
            'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "uniform" '
            'min: -0.5 max: 0.5 } }' % body)


def _run_convolution(body, shape, host):
    layer, bottom, top = build_layer(_conv_text(body), [randn(*shape)])
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = randn(*blob.shape, seed=3 + i)
    layer.engine = conv_host if host else conv_array    # the array engine: the GPU's passes
    layer.forward(bottom, top)
    top[0].diff[...] = randn(*top[0].shape, seed=4)
    for blob in layer.blobs:
        blob.diff[...] = 1.0              # param diffs accumulate
    layer.backward(top, [True], bottom)
    return [top[0].data, bottom[0].diff] + [blob.diff for blob in layer.blobs]


@pytest.mark.parametrize('phases', [True, False], ids=['phases', 'windows'])
@pytest.mark.parametrize('partial_sums', [True, False])
@pytest.mark.parametrize('chunking', CHUNKINGS, ids=lambda c: 'bytes %d narrow %d' % c)
@pytest.mark.parametrize('body, shape', GEOMETRIES)
def test_host_convolution_matches_the_array_path(body, shape, chunking, partial_sums, phases,
                                                 threads, monkeypatch):
    """Every chunking, on 1 to 3 threads, with the weight gradient summed per thread or
    the units run in turn, strided col2im by phases wherever it may or never."""
    monkeypatch.setattr(conv_columns, 'PHASE_OFFSETS', 0 if phases else 10 ** 9)
    monkeypatch.setattr(conv_cpu, 'PARTIAL_SUM_MIN_POSITIONS', 0 if partial_sums else 10 ** 9)
    monkeypatch.setattr(conv_cpu, 'COLUMN_BYTES', chunking[0])
    monkeypatch.setattr(conv_cpu, 'MIN_POSITIONS', 1)
    monkeypatch.setattr(conv_cpu, 'NARROW', chunking[1])
    monkeypatch.setattr(conv_cpu, 'FEW_GROUPS', 2)
    monkeypatch.setattr(cpu_threads, 'PARALLEL_GEMM_MIN_FLOPS', 1)
    expected = _run_convolution(body, shape, host=False)
    for got, want in zip(_run_convolution(body, shape, host=True), expected):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_host_convolution_chunks_cover_the_batch(monkeypatch):
    layer, _, _ = build_layer(_conv_text('num_output: 2 kernel_size: 3'), [randn(3, 2, 9, 7)])
    for budget in (1, 300, 10 ** 4, 10 ** 9):
        monkeypatch.setattr(conv_cpu, 'COLUMN_BYTES', budget)
        monkeypatch.setattr(conv_cpu, 'MIN_POSITIONS', 1)
        covered = np.zeros((3, 7), int)
        for chunk in conv_cpu.chunks(layer, 18):
            covered[chunk.first:chunk.last, chunk.row:chunk.row_end] += 1
        assert (covered == 1).all()


def test_host_convolution_in_place_1x1():
    """A 1x1 convolution with as many outputs as inputs may run in place."""
    text = _conv_text('num_output: 3 kernel_size: 1').replace('top: "y"', 'top: "x"')
    x = randn(2, 3, 4, 4)
    layer, bottom, _ = build_layer(text, [x])
    expected = (np.einsum('oc,nchw->nohw', layer.blobs[0].data.reshape(3, 3), x)
                + layer.blobs[1].data.reshape(1, 3, 1, 1))
    layer.forward(bottom, bottom)
    np.testing.assert_allclose(bottom[0].data, expected, rtol=1e-12)


@pytest.mark.parametrize('body', ['num_output: 3 kernel_size: 3 pad: 1',
                                  'num_output: 3 kernel_size: 1'])
def test_host_convolution_of_an_empty_batch(body):
    """A replica may hold no images of a batch: its convolution runs and adds nothing."""
    layer, bottom, top = build_layer(_conv_text(body), [np.zeros((0, 2, 5, 5))])
    layer.forward(bottom, top)
    assert top[0].shape == (0, 3, 5, 5)
    layer.backward(top, [True], bottom)
    assert not any(blob.diff.any() for blob in layer.blobs)


def test_host_convolution_with_bands_inside_the_padding(monkeypatch):
    """FCN's first convolution pads by 100: whole bands of output rows read only padding."""
    monkeypatch.setattr(conv_cpu, 'COLUMN_BYTES', 1)
    monkeypatch.setattr(conv_cpu, 'MIN_POSITIONS', 1)
    body, shape = 'num_output: 2 kernel_size: 3 pad: 7', (2, 1, 10, 3)
    expected = _run_convolution(body, shape, host=False)
    for got, want in zip(_run_convolution(body, shape, host=True), expected):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_host_convolution_is_deterministic_whichever_thread_runs_what(monkeypatch):
    """Weight-gradient sums go by part, not by thread: repeated runs agree bit for bit."""
    monkeypatch.setattr(conv_cpu, 'PARTIAL_SUM_MIN_POSITIONS', 0)
    monkeypatch.setattr(conv_cpu, 'COLUMN_BYTES', 1)
    before = cpu_threads.threads()
    cpu_threads.set_threads(3)
    try:
        runs = [_run_convolution('num_output: 4 kernel_size: 3 pad: 1', (6, 3, 9, 8), True)
                for _ in range(12)]
    finally:
        cpu_threads.set_threads(before)
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            np.testing.assert_array_equal(got, want)
