"""Batch normalization's CUDA engine (caffe_syncbn/layers/norm/gpu.py over cuda/norm.cu), run on
the CPU through the kernel emulation (tests/helpers/cuda_emulation.py): its passes against the
array engine (norm/array.py), channels split over several blocks, float32 sums about a large
mean, and replicas with uneven and empty batches against one layer. The layers on every
engine: test_norm.py. Small shapes: every CUDA thread is an OS thread here."""
import threading

import numpy as np
import pytest
from helpers import watchdog
from helpers.cuda_emulation import emulated_kernels

from caffe_syncbn.blob import Blob
from caffe_syncbn.comm import ThreadComm
from caffe_syncbn.layer import TRAIN, LayerContext, create_layer
from caffe_syncbn.layers.norm import array as norm_math, gpu as norm_gpu
from caffe_syncbn.testing import layer_param

TOL = {np.float64: 1e-10, np.float32: 2e-5, np.float16: 2e-2}


@pytest.fixture(autouse=True)
def _emulated(monkeypatch):
    emulated_kernels(monkeypatch)


def close(actual, expected, dtype, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    tol = TOL[dtype]
    err = np.max(np.abs(actual - expected) / np.maximum(1, np.abs(expected)), initial=0)
    assert err <= tol, '%s: error %.3g > %.3g' % (what, err, tol)


@pytest.mark.parametrize('dtype', [np.float64, np.float32, np.float16])
@pytest.mark.parametrize('shape', [(3, 2, 8), (2, 3, 5), (1, 1, 1)])
@pytest.mark.parametrize('about_reference', [False, True])
def test_local_sums_equal_the_array_engine(dtype, shape, about_reference):
    rs = np.random.RandomState(0)
    x3 = (rs.standard_normal(shape) * 3 + 50).astype(dtype)
    reference = rs.standard_normal(shape[1]).astype(dtype).astype(np.float64) \
        if about_reference else None
    want = norm_math.moments(*norm_math.local_sums(x3, reference))
    got = norm_math.moments(*norm_gpu.local_sums(x3, reference))
    accuracy = np.float64 if dtype == np.float64 else np.float32
    for a, b, what in zip(got, want, ('count', 'mean', 'var')):
        close(a, b, accuracy, what)


@pytest.mark.parametrize('dtype', [np.float64, np.float32])
@pytest.mark.parametrize('shape', [(3, 2, 8), (2, 3, 5)])
@pytest.mark.parametrize('x_hat_out', [False, True])
def test_engine_passes_equal_the_array_engine(dtype, shape, x_hat_out):
    rs = np.random.RandomState(1)
    x3 = (rs.standard_normal(shape) + 2).astype(dtype)
    dy3 = rs.standard_normal(shape).astype(dtype)
    mean, inv_std = rs.standard_normal(shape[1]) + 2, rs.uniform(0.5, 2, shape[1])
    slope, bias, scale = (rs.standard_normal(shape[1]) for _ in range(3))
    count = np.full(1, shape[0] * shape[2], np.float64)
    outputs = {}
    for engine in (norm_math, norm_gpu):
        y3 = np.empty_like(x3)
        buffer = np.empty_like(x3) if x_hat_out else None
        x_hat = engine.normalize(x3, y3, mean, inv_std, slope, bias, True, buffer)
        sums = engine.gradient_sums(dy3, x_hat)
        dx3, fixed_dx3 = np.empty_like(dy3), np.empty_like(dy3)
        engine.input_gradient(dx3, dy3, scale, x_hat, *sums, count=count)
        engine.input_gradient(fixed_dx3, dy3, scale)
        outputs[engine] = [y3, sums[0], sums[1], dx3, fixed_dx3]
    for a, b, what in zip(outputs[norm_gpu], outputs[norm_math],
                          ('y', 'sum(dy)', 'sum(dy*x_hat)', 'dx', 'dx (fixed statistics)')):
        close(a, b, dtype, what)


def make_layer(kind, extra, phase, dtype, shape, comm=None, seed=0, kernels=False):
    text = ('name: "bn" type: "%s" bottom: "x" top: "y" bn_param { momentum: 0.9 eps: 1e-4 '
            'slope_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 } '
            '%s }' % (kind, extra))
    context = LayerContext(phase=phase, dtype=dtype, comm=comm, cuda_kernels=kernels)
    layer = create_layer(layer_param(text), context)
    bottom, top = [Blob(shape, dtype)], [Blob((), dtype)]
    layer.setup(bottom, top)
    rs = np.random.RandomState(seed)
    layer.blobs[2].data[...] = rs.standard_normal(layer.blobs[2].shape)
    layer.blobs[3].data[...] = rs.uniform(0.5, 2, layer.blobs[3].shape)
    for b in layer.blobs[:2]:
        b.data[...] = rs.standard_normal(b.shape)
    return layer, bottom, top


def run_layer(layer, bottom, top, x, dy, in_place=False, steps=2):
    if in_place:
        top = bottom
    for _ in range(steps):
        bottom[0].reshape(x.shape)
        bottom[0].data[...] = x
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
    y = top[0].data.copy()
    for b in layer.blobs:
        b.diff[...] = 0
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    return [y, bottom[0].diff.copy()] + [b.data.copy() for b in layer.blobs] + \
        [b.diff.copy() for b in layer.blobs[:2]]


NAMES = ['y', 'dx', 'slope', 'bias', 'running mean', 'running var', 'dslope', 'dbias']


@pytest.mark.parametrize('splits', [2, 5])
@pytest.mark.parametrize('shape', [(3, 2, 7, 4), (3, 2, 9)])
def test_several_blocks_per_channel(monkeypatch, splits, shape):
    """Channel slices that split rows and vectors unevenly add up to the same sums."""
    monkeypatch.setattr(norm_gpu, '_splits', lambda x3: splits)
    rs = np.random.RandomState(6)
    x = (rs.standard_normal(shape) + 3).astype(np.float32)
    dy = rs.standard_normal(shape).astype(np.float32)
    want = run_layer(*make_layer('SyncBN', '', TRAIN, np.float32, shape), x, dy)
    got = run_layer(*make_layer('SyncBN', '', TRAIN, np.float32, shape, kernels=True), x, dy)
    for a, b, what in zip(got, want, NAMES):
        close(a, b, np.float32, what)


def test_large_mean_float32_has_no_cancellation():
    shape = (4, 2, 16)
    rs = np.random.RandomState(4)
    x64 = (rs.standard_normal(shape) + 1e4).astype(np.float32).astype(np.float64)
    dy = rs.standard_normal(shape)
    want = run_layer(*make_layer('SyncBN', '', TRAIN, np.float64, shape), x64, dy, steps=1)
    got = run_layer(*make_layer('SyncBN', '', TRAIN, np.float32, shape, kernels=True),
                    x64.astype(np.float32), dy.astype(np.float32), steps=1)
    for a, b, what in zip(got, want, NAMES):
        assert np.max(np.abs(a - b) / np.maximum(1, np.abs(b))) < 1e-3, what


def test_replicas_with_uneven_and_empty_batches_equal_one_layer():
    rs = np.random.RandomState(5)
    x = rs.standard_normal((7, 3, 2, 2)) * 2 - 1
    dy = rs.standard_normal(x.shape)
    splits = [0, 3, 3, 7]         # replica batches 3, 0, 4
    replicas = len(splits) - 1
    want = run_layer(*make_layer('SyncBN', '', TRAIN, np.float64, x.shape), x, dy)
    comms = ThreadComm.create(replicas)
    results = [None] * replicas

    def replica(r):
        part = slice(splits[r], splits[r + 1])
        layer = make_layer('SyncBN', '', TRAIN, np.float64, x.shape, comm=comms[r], kernels=True)
        # each replica's top diff is R times the one-device diff of its samples (norm.py)
        results[r] = run_layer(*layer, x[part], replicas * dy[part])

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(replicas)]
    for t in threads:
        t.start()
    watchdog.join(threads, 'the replicas', limit=120)
    assert all(res is not None for res in results)
    y = np.concatenate([res[0] for res in results])
    dx = np.concatenate([res[1] for res in results])
    close(y, want[0], np.float64, 'y')
    close(dx / replicas, want[1], np.float64, 'dx')
    for res in results:
        for k in (4, 5):
            np.testing.assert_array_equal(res[k], results[0][k])
            close(res[k], want[k + 0], np.float64, NAMES[k])
    for k in (6, 7):            # the solver averages param diffs over the replicas
        close(sum(res[k] for res in results) / replicas, want[k], np.float64, NAMES[k])
