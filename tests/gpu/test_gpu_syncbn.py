"""SyncBN on a real GPU: 4 replicas on one GPU (SameDeviceComm), NCCL with one rank, float16
inputs with float32 statistics, against the float64 CPU layer on the whole batch; and a
failing replica that must stop the others without a hang."""
import threading
import time

import numpy as np
import pytest
from gpu_support import require_gpu

cupy = require_gpu()
pytestmark = pytest.mark.gpu

from caffe_syncbn.blob import Blob  # noqa: E402
from caffe_syncbn.comm import CommAborted  # noqa: E402
from caffe_syncbn.comm.nccl import NcclComm  # noqa: E402
from caffe_syncbn.comm.same_device import SameDeviceComm  # noqa: E402
from caffe_syncbn.layer import TRAIN, LayerContext, create_layer  # noqa: E402
from caffe_syncbn.testing import layer_param  # noqa: E402

C = 8
TEXT = 'name: "bn" type: "SyncBN" bottom: "x" top: "y" bn_param { momentum: 0.9 eps: 1e-5 }'


def params(seed=0):
    rs = np.random.RandomState(seed)
    return [rs.standard_normal(C), rs.standard_normal(C), rs.standard_normal(C),
            rs.uniform(0.5, 2, C)]


def make(xp, dtype, comm=None, kernels=None):
    context = LayerContext(phase=TRAIN, xp=xp, dtype=dtype, comm=comm, cuda_kernels=kernels)
    layer = create_layer(layer_param(TEXT), context)
    bottom, top = [Blob((1, C, 2, 2), dtype, xp)], [Blob((), dtype, xp)]
    layer.setup(bottom, top)
    for blob, value in zip(layer.blobs, params()):
        blob.data[...] = xp.asarray(np.reshape(value, blob.shape), dtype)
    return layer, bottom, top


def step(layer, bottom, top, x, dy):
    xp = bottom[0].xp
    bottom[0].reshape(x.shape)
    bottom[0].data[...] = xp.asarray(x)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    for b in layer.blobs:
        b.diff[...] = 0
    top[0].diff[...] = xp.asarray(dy)
    layer.backward(top, [True], bottom)
    out = [top[0].data, bottom[0].diff] + [b.data for b in layer.blobs] + \
        [b.diff for b in layer.blobs[:2]]
    return [cupy.asnumpy(a) if xp is cupy else a.copy() for a in out]


def reference(x, dy, steps):
    layer, bottom, top = make(np, np.float64)
    for _ in range(steps):
        result = step(layer, bottom, top, x, dy)
    return result


def run_replicas(comms, x, dy, splits, dtype, steps, fused=True):
    results, errors = [None] * len(comms), [None] * len(comms)

    def replica(r):
        try:
            with cupy.cuda.Device(0), cupy.cuda.Stream(non_blocking=True) as stream:
                layer, bottom, top = make(cupy, dtype, comms[r], kernels=fused)
                part = slice(splits[r], splits[r + 1])
                for _ in range(steps):
                    res = step(layer, bottom, top, x[part].astype(dtype), dy[part].astype(dtype))
                stream.synchronize()
                results[r] = res
        except BaseException as exc:
            errors[r] = exc
            comms[r].abort(exc)

    threads = [threading.Thread(target=replica, args=(r,), daemon=True) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), 'replicas hang'
    for e in errors:
        if e is not None:
            raise e
    return results


def compare(results, want, tol):
    names = ['y', 'dx', 'slope', 'bias', 'running mean', 'running var', 'dslope', 'dbias']
    got = [np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results])]
    got += results[0][2:6]
    got += [sum(r[k] for r in results) for k in (6, 7)]    # local param diffs add up
    for r in results:                                      # identical running stats
        for k in (4, 5):
            np.testing.assert_array_equal(r[k], results[0][k])
    for a, b, name in zip(got, want, names):
        err = np.max(np.abs(a - b) / np.maximum(1, np.abs(b)))
        assert err <= tol, '%s: error %.3g > %.3g' % (name, err, tol)


@pytest.mark.parametrize('dtype,tol', [(np.float32, 1e-5), (np.float64, 1e-10)])
@pytest.mark.parametrize('splits', [[0, 3, 3, 8, 10], [0, 1, 2, 3, 4]])
def test_four_replicas_on_one_gpu_equal_one_bn(dtype, tol, splits):
    rs = np.random.RandomState(1)
    n = splits[-1]
    x = rs.standard_normal((n, C, 6, 5)) * 2 + 3
    dy = rs.standard_normal(x.shape)
    comms = SameDeviceComm.create(4, device=0, timeout=60)
    compare(run_replicas(comms, x, dy, splits, dtype, steps=2), reference(x, dy, 2), tol)


def test_nccl_with_one_rank():
    rs = np.random.RandomState(2)
    x = rs.standard_normal((5, C, 8, 8))
    dy = rs.standard_normal(x.shape)
    comms = NcclComm.create_all([0])
    compare(run_replicas(comms, x, dy, [0, 5], np.float32, steps=2), reference(x, dy, 2), 1e-5)


def test_float16_inputs_keep_float32_statistics():
    rs = np.random.RandomState(3)
    x = (rs.standard_normal((6, C, 8, 8)) + 100).astype(np.float16).astype(np.float64)
    dy = rs.standard_normal(x.shape).astype(np.float16).astype(np.float64)
    comms = SameDeviceComm.create(2, device=0)
    compare(run_replicas(comms, x, dy, [0, 2, 6], np.float16, steps=1), reference(x, dy, 1), 2e-2)


def test_layer_through_its_own_forward_on_cupy_matches():
    """Whatever norm.py dispatches to, a SyncBN layer on CuPy arrays equals the reference."""
    rs = np.random.RandomState(4)
    x = rs.standard_normal((4, C, 5, 3))
    dy = rs.standard_normal(x.shape)
    comms = SameDeviceComm.create(2, device=0)
    compare(run_replicas(comms, x, dy, [0, 1, 4], np.float32, steps=2, fused=False),
            reference(x, dy, 2), 1e-5)


def test_a_failing_replica_stops_the_others_without_a_hang():
    comms = SameDeviceComm.create(4, device=0, timeout=60)
    errors = [None] * 4

    def replica(r):
        try:
            with cupy.cuda.Device(0), cupy.cuda.Stream(non_blocking=True):
                layer, bottom, top = make(cupy, np.float32, comms[r])
                x = np.ones((2, C, 4, 4), np.float32) * r
                for k in range(5):
                    if r == 1 and k == 2:
                        raise RuntimeError('replica 1 failed at step 2')
                    step(layer, bottom, top, x, x)
        except BaseException as exc:
            errors[r] = exc
            comms[r].abort(exc)

    start = time.monotonic()
    threads = [threading.Thread(target=replica, args=(r,), daemon=True) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert time.monotonic() - start < 20
    assert isinstance(errors[1], RuntimeError)
    for r in (0, 2, 3):
        assert isinstance(errors[r], CommAborted), errors[r]
