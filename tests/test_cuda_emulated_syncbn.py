"""The SyncBN kernels (cuda/syncbn.cu) and their wrappers (caffe_syncbn/layers/norm_gpu.py),
run on the CPU through the kernel emulation (tests/cuda_emulation.py), against the CPU
layers of layers/norm.py. Small shapes: every CUDA thread is an OS thread here."""
import numpy as np
import pytest
from cuda_emulation import emulated_kernels

from caffe_syncbn.blob import Blob
from caffe_syncbn.comm import ThreadComm
from caffe_syncbn.layer import TEST, TRAIN, LayerContext, create_layer
from caffe_syncbn.layers import norm
from caffe_syncbn.testing import layer_param

TOL = {np.float64: 1e-10, np.float32: 2e-5, np.float16: 2e-2}


@pytest.fixture(autouse=True)
def _emulated(monkeypatch):
    emulated_kernels(monkeypatch)


def gpu():
    from caffe_syncbn.layers import norm_gpu as syncbn_gpu
    return syncbn_gpu


def close(actual, expected, dtype, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    tol = TOL[dtype]
    err = np.max(np.abs(actual - expected) / np.maximum(1, np.abs(expected)), initial=0)
    assert err <= tol, '%s: error %.3g > %.3g' % (what, err, tol)


@pytest.mark.parametrize('dtype', [np.float64, np.float32, np.float16])
@pytest.mark.parametrize('shape', [(3, 2, 8), (2, 3, 5), (1, 1, 1)])
def test_local_statistics_rebased_equal_cpu(dtype, shape):
    rs = np.random.RandomState(0)
    x3 = (rs.standard_normal(shape) * 3 + 50).astype(dtype)
    reference = rs.standard_normal(shape[1])
    want = norm.local_statistics(x3, np)
    got = gpu().local_statistics(x3, np)
    assert got[0] == want[0]
    for a, b, what in zip(norm.rebase_sums(got[0], got[2], got[3], got[1], reference),
                          norm.rebase_sums(want[0], want[2], want[3], want[1], reference),
                          ('s1', 's2')):
        close(a / got[0], b / got[0], np.float64 if dtype == np.float64 else np.float32, what)


@pytest.mark.parametrize('dtype', [np.float64, np.float32])
@pytest.mark.parametrize('shape', [(3, 2, 8), (2, 3, 5)])
def test_named_steps_equal_cpu(dtype, shape):
    rs = np.random.RandomState(1)
    x3 = (rs.standard_normal(shape) + 2).astype(dtype)
    dy3 = rs.standard_normal(shape).astype(dtype)
    mean, inv_std = rs.standard_normal(shape[1]) + 2, rs.uniform(0.5, 2, shape[1])
    scale = rs.standard_normal(shape[1])
    close(gpu().normalize(x3, mean, inv_std), norm.normalize(x3, mean, inv_std), dtype, 'x_hat')
    x_hat = norm.normalize(x3, mean, inv_std)
    for a, b in zip(gpu().gradient_sums(dy3, x_hat), norm.gradient_sums(dy3, x_hat)):
        close(a, b, dtype, 'gradient sums')
    sums = norm.gradient_sums(dy3, x_hat)
    count = shape[0] * shape[2]
    close(gpu().batch_input_gradient(dy3, x_hat, scale, *sums, count),
          norm.batch_input_gradient(dy3, x_hat, scale, *sums, count), dtype, 'dx')


def make_layer(kind, extra, phase, dtype, shape, comm=None, seed=0):
    text = ('name: "bn" type: "%s" bottom: "x" top: "y" bn_param { momentum: 0.9 eps: 1e-4 '
            'slope_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 } '
            '%s }' % (kind, extra))
    layer = create_layer(layer_param(text), LayerContext(phase=phase, dtype=dtype, comm=comm))
    bottom, top = [Blob(shape, dtype)], [Blob((), dtype)]
    layer.setup(bottom, top)
    rs = np.random.RandomState(seed)
    layer.blobs[2].data[...] = rs.standard_normal(layer.blobs[2].shape)
    layer.blobs[3].data[...] = rs.uniform(0.5, 2, layer.blobs[3].shape)
    for b in layer.blobs[:2]:
        b.data[...] = rs.standard_normal(b.shape)
    return layer, bottom, top


def run_layer(layer, bottom, top, x, dy, on_gpu, in_place=False, steps=2):
    if in_place:
        top = bottom
    for _ in range(steps):
        bottom[0].reshape(x.shape)
        bottom[0].data[...] = x
        layer.reshape(bottom, top)
        (gpu().layer_forward if on_gpu else layer.forward)(*((layer,) if on_gpu else ()), bottom, top)
    y = top[0].data.copy()
    for b in layer.blobs:
        b.diff[...] = 0
    top[0].diff[...] = dy
    (gpu().layer_backward if on_gpu else layer.backward)(
        *((layer,) if on_gpu else ()), top, [True], bottom)
    return [y, bottom[0].diff.copy()] + [b.data.copy() for b in layer.blobs] + \
        [b.diff.copy() for b in layer.blobs[:2]]


NAMES = ['y', 'dx', 'slope', 'bias', 'running mean', 'running var', 'dslope', 'dbias']


@pytest.mark.parametrize('kind,extra,phase', [
    ('SyncBN', '', TRAIN), ('BN', '', TRAIN), ('SyncBN', '', TEST), ('BN', '', TEST),
    ('SyncBN', 'frozen: true', TRAIN), ('BN', 'frozen: true', TEST)])
@pytest.mark.parametrize('dtype', [np.float64, np.float32])
@pytest.mark.parametrize('in_place', [False, True])
def test_fused_layer_equals_cpu_layer(kind, extra, phase, dtype, in_place):
    shape = (3, 4, 2, 4)
    rs = np.random.RandomState(2)
    x = (rs.standard_normal(shape) * 2 + 1).astype(dtype)
    dy = rs.standard_normal(shape).astype(dtype)
    want = run_layer(*make_layer(kind, extra, phase, dtype, shape), x, dy, False, in_place)
    got = run_layer(*make_layer(kind, extra, phase, dtype, shape), x, dy, True, in_place)
    for a, b, what in zip(got, want, NAMES):
        close(a, b, dtype, what)


@pytest.mark.parametrize('shape', [(2, 3, 3, 3), (4, 2), (3, 2, 16)])
def test_fused_layer_odd_shapes_and_float16(shape):
    rs = np.random.RandomState(3)
    x = (rs.standard_normal(shape) + 1).astype(np.float32)
    dy = rs.standard_normal(shape).astype(np.float32)
    want = run_layer(*make_layer('SyncBN', '', TRAIN, np.float32, shape), x, dy, False)
    got = run_layer(*make_layer('SyncBN', '', TRAIN, np.float32, shape), x, dy, True)
    for a, b, what in zip(got, want, NAMES):
        close(a, b, np.float32, what)
    got16 = run_layer(*make_layer('SyncBN', '', TRAIN, np.float16, shape), x.astype(np.float16),
                      dy.astype(np.float16), True)
    for a, b, what in zip(got16, want, NAMES):
        close(a, b, np.float16, what + ' (float16)')


@pytest.mark.parametrize('splits', [2, 5])
@pytest.mark.parametrize('shape', [(3, 2, 7, 4), (3, 2, 9)])
def test_several_blocks_per_channel(monkeypatch, splits, shape):
    """Channel slices that split rows and vectors unevenly add up to the same sums."""
    monkeypatch.setattr(gpu(), '_splits', lambda x3: splits)
    rs = np.random.RandomState(6)
    x = (rs.standard_normal(shape) + 3).astype(np.float32)
    dy = rs.standard_normal(shape).astype(np.float32)
    want = run_layer(*make_layer('SyncBN', '', TRAIN, np.float32, shape), x, dy, False)
    got = run_layer(*make_layer('SyncBN', '', TRAIN, np.float32, shape), x, dy, True)
    for a, b, what in zip(got, want, NAMES):
        close(a, b, np.float32, what)


def test_large_mean_float32_has_no_cancellation():
    shape = (4, 2, 16)
    rs = np.random.RandomState(4)
    x64 = (rs.standard_normal(shape) + 1e4).astype(np.float32).astype(np.float64)
    dy = rs.standard_normal(shape)
    want = run_layer(*make_layer('SyncBN', '', TRAIN, np.float64, shape), x64, dy, False, steps=1)
    got = run_layer(*make_layer('SyncBN', '', TRAIN, np.float32, shape), x64.astype(np.float32),
                    dy.astype(np.float32), True, steps=1)
    for a, b, what in zip(got, want, NAMES):
        assert np.max(np.abs(a - b) / np.maximum(1, np.abs(b))) < 1e-3, what


def test_replicas_with_uneven_and_empty_batches_equal_one_layer():
    rs = np.random.RandomState(5)
    x = rs.standard_normal((7, 3, 2, 2)) * 2 - 1
    dy = rs.standard_normal(x.shape)
    splits = [0, 3, 3, 7]         # replica batches 3, 0, 4
    replicas = len(splits) - 1
    want = run_layer(*make_layer('SyncBN', '', TRAIN, np.float64, x.shape), x, dy, False)
    comms = ThreadComm.create(replicas, timeout=60)
    results = [None] * replicas

    def replica(r):
        part = slice(splits[r], splits[r + 1])
        layer = make_layer('SyncBN', '', TRAIN, np.float64, x.shape, comm=comms[r])
        # each replica's top diff is R times the one-device diff of its samples (norm.py)
        results[r] = run_layer(*layer, x[part], replicas * dy[part], True)

    import threading
    threads = [threading.Thread(target=replica, args=(r,)) for r in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
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
