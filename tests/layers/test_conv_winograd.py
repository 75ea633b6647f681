"""Winograd F(2x2, 3x3) (layers/conv/host_winograd.py): finite-difference gradients, float32
results within the stated bound of float64 im2col for every class of shape, results that
do not depend on the thread count, the chunking or the bands of the tile transforms, what
a forward allocates, and which layers it runs."""
import threading
import tracemalloc

import numpy as np
import pytest

from caffe_syncbn.backend import cpu_threads
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layers.conv import array as conv_array, host as conv_host, \
    host_depthwise as depthwise_cpu, host_gemm as conv_cpu, host_winograd as winograd_cpu
from caffe_syncbn.testing import build_layer, check_gradient
from helpers.arrays import randn


@pytest.fixture
def forced(monkeypatch):
    """Winograd wherever it applies, whatever the rule says of the shape."""
    monkeypatch.setenv(winograd_cpu.MODE_VARIABLE, 'on')


def _conv_text(body):
    return ('name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param { '
            'kernel_size: 3 %s weight_filler { type: "gaussian" std: 0.5 } '
            'bias_filler { type: "uniform" min: -0.5 max: 0.5 } }' % body)


# (convolution_param, input shape): pad 0, 1 and 2; odd and even H and W; H or W below 4
# (and outputs of one row or column); one input channel; many channels; groups; with and
# without bias; batches of 1 and several
SHAPES = [
    ('num_output: 3 pad: 1', (2, 2, 6, 8)),
    ('num_output: 4', (1, 3, 7, 5)),
    ('num_output: 2 pad: 2 bias_term: false', (3, 2, 5, 6)),
    ('num_output: 5 pad: 1', (2, 3, 1, 7)),
    ('num_output: 3', (2, 2, 3, 9)),
    ('num_output: 2 pad: 1', (1, 4, 2, 3)),
    ('num_output: 6 pad: 1', (2, 1, 9, 8)),
    ('num_output: 6 pad: 1 group: 2', (3, 4, 7, 7)),
    ('num_output: 48 pad: 1', (2, 96, 10, 9)),
    ('num_output: 32 pad: 0 group: 4 bias_term: false', (1, 64, 12, 13)),
]


@pytest.mark.parametrize('body, shape', [
    ('num_output: 3 pad: 1', (2, 2, 5, 4)),
    ('num_output: 2', (1, 2, 3, 6)),
    ('num_output: 4 pad: 2 group: 2 bias_term: false', (2, 4, 3, 2)),
])
def test_finite_difference_gradients(body, shape, forced):
    layer, _, _ = build_layer(_conv_text(body), [randn(*shape)])
    assert conv_host.runs(layer) is winograd_cpu
    check_gradient(_conv_text(body), [randn(*shape)])


def _run(body, shape, dtype, absolute=False, host=True):
    """Forward and backward of one layer: [top, bottom diff, weight diff (, bias diff)].
    ``absolute``: on |x|, |w|, |b| and |top diff|, which makes every output the sum of
    the magnitudes of the products it adds up."""
    def values(*s, seed):
        v = randn(*s, seed=seed)
        return np.abs(v) if absolute else v
    layer, bottom, top = build_layer(_conv_text(body), [values(*shape, seed=0)], dtype=dtype)
    layer.engine = conv_host if host else conv_array    # the array engine: im2col + GEMM
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = values(*blob.shape, seed=3 + i)
    layer.forward(bottom, top)
    top[0].diff[...] = values(*top[0].shape, seed=4)
    layer.backward(top, [True], bottom)
    return layer, [np.array(a, np.float64) for a in
                   [top[0].data, bottom[0].diff] + [blob.diff for blob in layer.blobs]]


def _scale(magnitude, index):
    """The bound's scale of each element: the largest sum of |products| among its
    neighbours, the cells within one row and one column of it for the top and the bottom
    diff, the 9 taps of its kernel for the weight diff (index 2)."""
    if index == 2:
        return np.broadcast_to(magnitude.max(axis=(2, 3), keepdims=True), magnitude.shape)
    if index == 3:                                  # the bias diff: one sum per output
        return magnitude
    h, w = magnitude.shape[2:]
    padded = np.pad(magnitude, ((0, 0), (0, 0), (1, 1), (1, 1)))
    return np.max([padded[:, :, i:i + h, j:j + w] for i in range(3) for j in range(3)], axis=0)


def _excess(body, shape, positive=False):
    """The largest excess of |winograd (float32) - im2col (float64)| over the bound, for
    the top, the bottom diff, the weight and the bias diffs."""
    layer, got = _run(body, shape, np.float32, absolute=positive)
    assert conv_host.runs(layer) is winograd_cpu
    _, want = _run(body, shape, np.float64, absolute=positive, host=False)
    _, magnitude = _run(body, shape, np.float64, absolute=True, host=False)
    return [float((np.abs(g - w) - winograd_cpu.ERROR_BOUND * _scale(m, i)).max())
            for i, (g, w, m) in enumerate(zip(got, want, magnitude))]


CHUNKINGS = ['bands of 1 tile row', 'bands of 2 tile rows', 'single images', 'whole batch']


def _chunks(chunking):
    """A ``winograd_cpu.chunks`` that cuts every batch as ``chunking`` says."""
    def chunks(layer):
        rows, n = winograd_cpu.tiles(layer)[0], layer.batch
        if chunking == 'whole batch':
            return [(0, n, 0, rows)]
        height = {'bands of 1 tile row': 1, 'bands of 2 tile rows': 2}.get(chunking, rows)
        return [(i, i + 1, t, min(rows, t + height))
                for i in range(n) for t in range(0, rows, height)]
    return chunks


@pytest.mark.parametrize('chunking', CHUNKINGS)
@pytest.mark.parametrize('body, shape', SHAPES)
def test_float32_within_the_bound_of_float64_im2col(body, shape, chunking, forced,
                                                    monkeypatch):
    monkeypatch.setattr(winograd_cpu, 'chunks', _chunks(chunking))
    assert max(_excess(body, shape)) <= 0


def test_sums_of_one_sign_within_the_bound(forced):
    """Inputs, weights and top diff all positive: nothing cancels, and float32 rounding
    adds up over the 2304 products of each output (as it does in im2col's GEMMs)."""
    assert max(_excess('num_output: 64 pad: 1', (2, 256, 10, 12), positive=True)) <= 0


def test_the_bound_is_tight_enough_to_catch_a_wrong_transform(forced, monkeypatch):
    """Weights transformed 2^-14 too large break the bound: the tests above can fail."""
    monkeypatch.setattr(winograd_cpu, 'KRON_G', winograd_cpu.KRON_G * (1 + 2.0 ** -14))
    assert _excess(*SHAPES[0])[0] > 0


def test_float64_matches_im2col(forced):
    for body, shape in SHAPES:
        _, got = _run(body, shape, np.float64)
        _, want = _run(body, shape, np.float64, host=False)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize('chunking', CHUNKINGS)
@pytest.mark.parametrize('body, shape', [SHAPES[0], SHAPES[-1], SHAPES[-3]])
def test_the_same_bits_on_any_number_of_threads(body, shape, chunking, forced, monkeypatch):
    """Every pass split over as many threads as it has rows of tiles (or, in the
    forward, chunks), against one thread, which the test above checks."""
    monkeypatch.setattr(cpu_threads, 'PARALLEL_GEMM_MIN_FLOPS', 1)
    monkeypatch.setattr(cpu_threads, 'PARALLEL_MIN_ELEMENTS', 1)
    monkeypatch.setattr(winograd_cpu, 'chunks', _chunks(chunking))
    before = cpu_threads.threads()
    runs = []
    try:
        for count in (1, 2, 3, 2, 3):
            cpu_threads.set_threads(count)
            runs.append(_run(body, shape, np.float32)[1])
    finally:
        cpu_threads.set_threads(before)
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            np.testing.assert_array_equal(got, want)


def test_chunks_cover_every_tile_once(monkeypatch):
    layer, _, _ = build_layer(_conv_text('num_output: 4 pad: 1'), [randn(3, 2, 9, 7)])
    for budget in (1, 3000, 20000, 10 ** 9):
        monkeypatch.setattr(winograd_cpu, 'CHUNK_BYTES', budget)
        monkeypatch.setattr(winograd_cpu, 'MIN_TILES', 1)
        covered = np.zeros((3, 5), int)           # 9 output rows: 5 rows of tiles
        for n0, n1, t0, t1 in winograd_cpu.chunks(layer):
            covered[n0:n1, t0:t1] += 1
        assert (covered == 1).all()


@pytest.mark.parametrize('body, shape', [SHAPES[0], SHAPES[6], SHAPES[-2], SHAPES[-1]])
def test_the_same_bits_in_bands_of_any_height(body, shape, forced, monkeypatch):
    """The tile transforms by bands of one tile row against one band a chunk, which the
    bound tests check."""
    whole = _run(body, shape, np.float32)[1]
    monkeypatch.setattr(winograd_cpu, 'TRANSFORM_BYTES', 1)
    for got, want in zip(_run(body, shape, np.float32)[1], whole):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('outputs, channels', [(32, 64), (64, 32)])
def test_the_forward_writes_m_over_v(outputs, channels, forced, monkeypatch):
    """What a forward allocates (numpy's arrays, as tracemalloc sees them): one chunk's V
    or M, whichever is wider, with the weights' U, the products of a few frequencies on
    their way and small bands of transforms, not V and M side by side. It runs in a
    thread of its own, whose buffers start empty."""
    monkeypatch.setattr(winograd_cpu, 'TRANSFORM_BYTES', 1 << 12)
    layer, bottom, top = build_layer(_conv_text('num_output: %d pad: 1' % outputs),
                                     [randn(1, channels, 40, 40)], dtype=np.float32)
    assert len(winograd_cpu.chunks(layer)) == 1          # the image in one chunk
    wider, narrower = (16 * 20 * 20 * 4 * c for c in sorted((outputs, channels))[::-1])
    peaks = []

    def forward():
        tracemalloc.start()
        layer.forward(bottom, top)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    before = cpu_threads.threads()
    cpu_threads.set_threads(1)
    try:
        thread = threading.Thread(target=forward)
        thread.start()
        thread.join()
    finally:
        cpu_threads.set_threads(before)
    assert wider <= peaks[0] < wider + narrower


# ---------------------------------------------------------------- which layers it runs

@pytest.mark.parametrize('body, shape', [
    ('num_output: 4 stride: 2 pad: 1', (1, 4, 8, 8)),
    ('num_output: 4 dilation: 2 pad: 2', (1, 4, 8, 8)),
    ('num_output: 4 pad: 1', (1, 4, 4, 4, 4)),                     # 3-D
    ('num_output: 4 pad: 1 engine: CAFFE', (1, 4, 8, 8)),
])
def test_layers_it_does_not_run(body, shape, forced):
    layer, _, _ = build_layer(_conv_text(body), [randn(*shape)])
    assert not layer.winograd and conv_host.runs(layer) is conv_cpu


def test_depthwise_layers_keep_their_own_path(forced):
    layer, _, _ = build_layer(_conv_text('num_output: 4 pad: 1 group: 4'), [randn(1, 4, 8, 8)])
    assert conv_host.runs(layer) is depthwise_cpu


def test_the_variable_turns_it_off_and_on(monkeypatch):
    text = _conv_text('num_output: 8 pad: 1')
    monkeypatch.setenv(winograd_cpu.MODE_VARIABLE, 'off')
    assert conv_host.runs(build_layer(text, [randn(1, 8, 8, 8)])[0]) is conv_cpu
    layer, _, _ = build_layer(text, [randn(1, 8, 8, 8)])
    monkeypatch.setenv(winograd_cpu.MODE_VARIABLE, 'on')
    assert not layer.winograd             # chosen off at setup: no Winograd for this layer
    assert conv_host.runs(build_layer(text, [randn(1, 8, 8, 8)])[0]) is winograd_cpu
    monkeypatch.setenv(winograd_cpu.MODE_VARIABLE, 'sometimes')
    with pytest.raises(CaffeError, match='CAFFE_SYNCBN_WINOGRAD=sometimes'):
        build_layer(text, [randn(1, 8, 8, 8)])


@pytest.mark.parametrize('body, shape, picks', [
    ('num_output: 64 pad: 1', (1, 64, 20, 24), False),             # 120 tiles
    ('num_output: 64 pad: 1', (2, 64, 16, 16), True),              # 128 tiles
    ('num_output: 64 pad: 1', (4, 32, 16, 16), False),             # 32 input channels
    ('num_output: 32 pad: 1', (4, 64, 16, 16), False),             # 32 outputs
    ('num_output: 128 pad: 1 group: 2', (1, 128, 24, 24), True),   # 64 a group, 144 tiles
    ('num_output: 128 pad: 1 group: 4', (1, 128, 24, 24), False),  # 32 a group
    ('num_output: 64 pad: 1', (8, 64, 12, 14), False),             # 42 tiles an image
    ('num_output: 64 pad: 1', (3, 64, 14, 13), True),              # 49 tiles an image
])
def test_the_rule_goes_by_channels_per_group_and_tiles(body, shape, picks, monkeypatch):
    monkeypatch.delenv(winograd_cpu.MODE_VARIABLE, raising=False)
    layer, _, _ = build_layer(_conv_text(body), [randn(*shape)])
    assert layer.winograd
    assert (conv_host.runs(layer) is winograd_cpu) == picks


def test_the_rule_follows_the_batch_of_each_reshape(monkeypatch):
    """The engine is chosen at each pass from the shape of that pass; forward and
    backward of one shape agree with im2col either way."""
    monkeypatch.delenv(winograd_cpu.MODE_VARIABLE, raising=False)
    layer, bottom, top = build_layer(_conv_text('num_output: 64 pad: 1'),
                                     [randn(1, 64, 16, 16)])
    assert conv_host.runs(layer) is conv_cpu
    bottom[0].reshape((2, 64, 16, 16))
    bottom[0].data[...] = randn(2, 64, 16, 16)
    layer.reshape(bottom, top)
    assert conv_host.runs(layer) is winograd_cpu
    layer.forward(bottom, top)
    top[0].diff[...] = randn(*top[0].shape, seed=1)
    layer.backward(top, [True], bottom)
    got = [top[0].data.copy(), bottom[0].diff.copy(), layer.blobs[0].diff.copy()]
    layer.engine = conv_array
    for blob in layer.blobs:
        blob.diff[...] = 0
    layer.forward(bottom, top)
    layer.backward(top, [True], bottom)
    for g, w in zip(got, [top[0].data, bottom[0].diff, layer.blobs[0].diff]):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)
