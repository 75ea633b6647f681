"""The numpy fast paths against the plain array code they replace: every chunking of a
convolution, GEMMs split over threads and accumulated in place, and the in-place
elementwise layers, in float64 so that any difference is a bug, not rounding."""
import threading

import numpy as np
import pytest

from caffe_syncbn.backend import cpu_threads
from caffe_syncbn.layers.conv import array as conv_array, host as conv_host, \
    host_columns as conv_columns, host_gemm as conv_cpu
from caffe_syncbn.layers.norm import array as norm_math, host as norm_cpu
from caffe_syncbn.testing import build_layer
from conftest import randn


# ---------------------------------------------------------------- the thread pool

def test_split_covers_every_index_once(threads):
    for count, min_part in [(0, 1), (1, 1), (7, 1), (1000, 3), (5, 10)]:
        seen = np.zeros(count, int)
        lock = threading.Lock()

        def work(a, b):
            with lock:
                seen[a:b] += 1
        cpu_threads.split(count, work, min_part)
        assert (seen == 1).all()


def test_split_raises_the_error_of_a_part_after_every_part_ran(threads):
    ran = []

    def work(a, b):
        ran.append(a)
        if b == 10:                         # the last part, whichever thread runs it
            raise ValueError('part %d' % a)
    with pytest.raises(ValueError, match='part'):
        cpu_threads.split(10, work)
    assert len(ran) == threads


def test_nested_splits_finish(threads):
    total = np.zeros(64)

    def outer(a, b):
        cpu_threads.split(b - a, lambda c, d: total.__setitem__(slice(a + c, a + d),
                                                               total[a + c:a + d] + 1))
    cpu_threads.split(64, outer)
    assert (total == 1).all()


@pytest.mark.parametrize('m, k, n', [(1, 1, 1), (3, 5, 2), (64, 300, 200), (300, 40, 2000),
                                     (2000, 4, 300), (300, 1, 200), (5, 1, 3000)])
def test_matmul_and_accumulate(threads, monkeypatch, m, k, n):
    monkeypatch.setattr(cpu_threads, 'PARALLEL_GEMM_MIN_FLOPS', 1)
    monkeypatch.setattr(cpu_threads, 'ACCUMULATE_CHUNK_BYTES', 4096)
    a, b = randn(m, k), randn(k, n, seed=1)
    np.testing.assert_allclose(cpu_threads.matmul(a, b), a @ b, rtol=1e-12, atol=1e-12)
    out = randn(m, n, seed=2)
    expected = out + a @ b
    cpu_threads.matmul(a, b, out=out, accumulate=True)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    # transposed operands and a strided output, as the layers pass them
    wide = np.zeros((m, n + 3))
    cpu_threads.matmul(np.ascontiguousarray(a.T).T, np.ascontiguousarray(b.T).T,
                       out=wide[:, 1:n + 1], accumulate=True)
    np.testing.assert_allclose(wide[:, 1:n + 1], a @ b, rtol=1e-12, atol=1e-12)
    assert not wide[:, 0].any() and not wide[:, n + 1:].any()


# ---------------------------------------------------------------- convolution

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
# (COLUMN_BYTES, NARROW): one-row bands, single images, a few images, the whole batch;
# the images first or last in the columns
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


# ---------------------------------------------------------------- fillers

@pytest.mark.parametrize('filler', [
    'type: "constant" value: 0.25', 'type: "uniform" min: -2 max: 3',
    'type: "gaussian" std: 0.5 mean: 1', 'type: "xavier" variance_norm: AVERAGE',
    'type: "msra"', 'type: "gaussian" std: 2 sparse: 3', 'type: "positive_unitball"'])
def test_fill_in_chunks_draws_what_one_draw_gives(filler, monkeypatch):
    """fill() writes float32 in chunks; the values are those of one float64 draw."""
    from google.protobuf import text_format

    from caffe_syncbn import caffe_pb2
    from caffe_syncbn.blob import Blob
    from caffe_syncbn.fillers import fill, filled_array, set_random_seed
    param = text_format.Parse(filler, caffe_pb2.FillerParameter())
    monkeypatch.setattr('caffe_syncbn.fillers.FILL_CHUNK', 7)
    set_random_seed(11)
    expected = filled_array(param, (5, 4, 3)).astype(np.float32)
    set_random_seed(11)
    blob = Blob((5, 4, 3), np.float32)
    fill(param, blob)
    np.testing.assert_array_equal(blob.data, expected)


# ---------------------------------------------------------------- MAX pooling

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
    from caffe_syncbn.layers.pooling import host as pooling_cpu
    x = np.round(randn(*shape)) if ties else randn(*shape)       # ties: many equal values
    text = ('name: "p" type: "Pooling" bottom: "x" top: "y" top: "mask" pooling_param { '
            'pool: MAX %s }' % body)
    results = []
    for cells in (64, 0):             # the host path, then the separable array code
        monkeypatch.setattr(pooling_cpu, 'MAX_CELLS', cells)
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
    from caffe_syncbn.layers.pooling.array import Pool2d
    pool = Pool2d('AVE', shape[2:], shape[2:], (1, 1), (0, 0), True, ValueError)
    assert pool.whole
    x = (randn(*shape) * 10).astype(np.float32)
    dy = randn(shape[0], shape[1], 1, 1, seed=3).astype(np.float32)
    y, dx = pool.forward(x, 0, None), pool.backward(dy, 0).copy()
    pool.whole = False
    np.testing.assert_array_equal(y, pool.forward(x, 0, None))
    np.testing.assert_array_equal(dx, pool.backward(dy, 0))


# ---------------------------------------------------------------- batch norm, LRN

NORMS = [
    'type: "BatchNorm"',
    'type: "BatchNorm" batch_norm_param { use_global_stats: true }',
    'type: "BN" bn_param { momentum: 0.9 }',
    'type: "BN" bn_param { frozen: true }',
    'type: "SyncBN" bn_param { momentum: 0.9 }',
    'type: "SyncBN" bn_param { frozen: true }',
]


def _run_norm(text, shape, phase, in_place, host, learned=(True, True)):
    from caffe_syncbn.blob import Blob
    from caffe_syncbn.layer import LayerContext, create_layer
    from caffe_syncbn.testing import layer_param
    layer = create_layer(layer_param(text), LayerContext(phase=phase, dtype=np.float64))
    x = Blob(shape, np.float64)
    x.data[...] = randn(*shape) * 3 + 5
    top = x if in_place else Blob((), np.float64)
    layer.setup([x], [top])
    layer.reshape([x], [top])
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = np.abs(randn(*blob.shape, seed=i + 1)) + 0.5
    layer.engine = norm_cpu if host else norm_math
    if len(layer.blobs) == 4:
        layer.param_propagate_down = list(learned) + [False, False]
    layer.forward([x], [top])
    y = top.data.copy()
    top.diff[...] = randn(*shape, seed=9)
    layer.backward([top], [True], [x])
    return [y, x.diff] + [b.diff for b in layer.blobs] + [b.data for b in layer.blobs]


@pytest.mark.parametrize('learned', [(True, True), (False, True), (True, False)],
                         ids=['slope and bias', 'bias', 'slope'])
@pytest.mark.parametrize('in_place', [False, True])
@pytest.mark.parametrize('phase', [0, 1], ids=['TRAIN', 'TEST'])
@pytest.mark.parametrize('body', NORMS)
def test_host_batch_norm_matches_the_array_path(body, phase, in_place, learned, threads,
                                                monkeypatch):
    monkeypatch.setattr(cpu_threads, 'BLOCK_BYTES', 64)       # many blocks
    monkeypatch.setattr(cpu_threads, 'PARALLEL_MIN_ELEMENTS', 1)
    text = 'name: "bn" %s bottom: "x" top: "%s"' % (body, 'x' if in_place else 'y')
    for shape in [(3, 4, 5, 2), (2, 3), (4, 2, 1, 1)]:
        expected = _run_norm(text, shape, phase, in_place, False, learned)
        for got, want in zip(_run_norm(text, shape, phase, in_place, True, learned), expected):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_host_batch_norm_keeps_x_hat_only_in_place_when_its_backward_reads_it():
    text = 'name: "bn" type: "BatchNorm" bottom: "x" top: "%s" %s'
    x = randn(2, 3, 4, 4)
    for top, param, kept in [('x', '', True), ('y', '', False),
                             ('x', 'batch_norm_param { use_global_stats: true }', False)]:
        layer, bottom, tops = build_layer(text % (top, param), [x])
        tops = bottom if top == 'x' else tops
        layer.forward(bottom, tops)
        held = layer._x_hat is not None and layer._x_hat.kept is not None
        assert held == kept, (top, param)


@pytest.mark.parametrize('body', ['local_size: 5 alpha: 0.1 beta: 0.75 k: 2',
                                  'local_size: 3 alpha: 1e-4 beta: 0.75'])
def test_host_lrn_matches_the_array_path(body, threads, monkeypatch):
    from caffe_syncbn.layers.lrn import array, host
    monkeypatch.setattr(host, 'BAND_BYTES', 64)          # bands of 2 positions
    text = 'name: "n" type: "LRN" bottom: "x" top: "y" lrn_param { %s }' % body
    results = []
    for engine in (host, array):
        layer, bottom, top = build_layer(text, [randn(2, 7, 3, 5)])
        layer.engine = engine
        layer.forward(bottom, top)
        top[0].diff[...] = randn(*top[0].shape, seed=3)
        layer.backward(top, [True], bottom)
        results.append([top[0].data.copy(), bottom[0].diff.copy()])
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('body', ['num_output: 3 kernel_size: 3 pad: 1',
                                  'num_output: 3 kernel_size: 1'])
def test_host_convolution_of_an_empty_batch(body):
    """A replica may hold no images of a batch: its convolution runs and adds nothing."""
    layer, bottom, top = build_layer(_conv_text(body), [np.zeros((0, 2, 5, 5))])
    layer.forward(bottom, top)
    assert top[0].shape == (0, 3, 5, 5)
    layer.backward(top, [True], bottom)
    assert not any(blob.diff.any() for blob in layer.blobs)


def test_blob_diff_is_made_on_first_use():
    from caffe_syncbn.blob import Blob
    blob = Blob((2, 3))
    assert blob._diff is None
    blob.reshape(3, 2)
    assert blob._diff is None and blob.diff.shape == (3, 2) and not blob.diff.any()
    blob.diff[...] = 1
    blob.reshape(6)                      # same count: the values stay
    assert blob.diff.shape == (6,) and blob.diff.all()
    blob.reshape(4)
    assert blob.diff.shape == (4,) and not blob.diff.any()


def test_host_convolution_with_bands_inside_the_padding(monkeypatch):
    """FCN's first convolution pads by 100: whole bands of output rows read only padding."""
    monkeypatch.setattr(conv_cpu, 'COLUMN_BYTES', 1)
    monkeypatch.setattr(conv_cpu, 'MIN_POSITIONS', 1)
    body, shape = 'num_output: 2 kernel_size: 3 pad: 7', (2, 1, 10, 3)
    expected = _run_convolution(body, shape, host=False)
    for got, want in zip(_run_convolution(body, shape, host=True), expected):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_interp_in_blocks_gives_the_forks_bits(monkeypatch):
    """Interp's forward in blocks of planes: bit for bit the fork's float32 arithmetic,
    w0 * a + w1 * b along W, then along H, over the whole array at once."""
    from caffe_syncbn.layers.interp.array import interp_taps
    monkeypatch.setattr(cpu_threads, 'BLOCK_BYTES', 64)
    x = np.random.RandomState(5).standard_normal((2, 3, 6, 5)).astype(np.float32)
    layer, bottom, top = build_layer('name: "i" type: "Interp" bottom: "x" top: "y" '
                                     'interp_param { height: 11 width: 9 }', [x],
                                     dtype=np.float32)
    layer.forward(bottom, top)
    (hf, hs, hw), (wf, ws, ww) = interp_taps(6, 11), interp_taps(5, 9)
    along_w = (1 - ww) * x[:, :, :, wf] + ww * x[:, :, :, ws]
    expected = (1 - hw)[:, None] * along_w[:, :, hf] + hw[:, None] * along_w[:, :, hs]
    np.testing.assert_array_equal(top[0].data, expected)


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

