"""SyncBN on N replicas (threads + ThreadComm) equals one BN over the whole batch.

The reference is an independent float64 numpy BN over the concatenated global batch,
with SyncBN's running-stat convention (momentum, UNBIASED global variance).

Param-gradient rule (see caffe_syncbn/layers/norm.py): a replica's param diffs are
sums over its LOCAL batch; the solver averages them over R replicas, and the global
loss normalizer makes each replica's top diff R times the one-device gradient of its
samples. The tests feed exactly such top diffs (R * dy[slice]).
"""
import time

import numpy as np
import pytest
from helpers.counting_comm import CountingComm
from helpers.threads import run_threads

from caffe_syncbn.blob import Blob
from caffe_syncbn.comm import CollectiveMismatch, CommAborted, ThreadComm
from caffe_syncbn.layer import TEST, TRAIN, LayerContext, create_layer
from caffe_syncbn.precision import activation_dtype
from caffe_syncbn.testing import layer_param

MOMENTUM = float(np.float32(0.9))      # bn_param.momentum is a proto float
EPS = float(np.float32(1e-4))
C = 3


def syncbn_text(name='bn', extra=''):
    return ('name: "%s" type: "SyncBN" bottom: "x" top: "y" '
            'bn_param { momentum: 0.9 eps: 1e-4 %s }' % (name, extra))


run_replicas = run_threads


def run_ok(fn, n):
    results, errors = run_replicas(fn, n)
    for e in errors:
        if e is not None:
            raise e
    return results


class Replica:
    """One replica's SyncBN layer on its own blobs, as a replica Net would hold it."""

    def __init__(self, comm, params, text=None, phase=TRAIN, dtype=np.float64,
                 activation_dtype=None):
        self.dtype = dtype
        self.layer = create_layer(layer_param(text or syncbn_text()),
                                  LayerContext(phase=phase, dtype=dtype, comm=comm,
                                               activation_dtype=activation_dtype))
        blobs = activation_dtype or dtype              # a Net's blobs under mixed precision
        self.bottom, self.top = [Blob((1, C, 4, 5), blobs)], [Blob((), blobs)]
        self.layer.setup(self.bottom, self.top)
        for blob, value in zip(self.layer.blobs, params):
            blob.data[...] = np.reshape(value, blob.shape)

    def forward(self, x):
        self.bottom[0].reshape(x.shape)
        self.bottom[0].data[...] = x
        self.layer.reshape(self.bottom, self.top)
        self.layer.forward(self.bottom, self.top)
        return self.top[0].data.copy()

    def backward(self, dy):
        self.top[0].diff[...] = dy
        for blob in self.layer.blobs:
            blob.diff[...] = 0
        self.layer.backward(self.top, [True], self.bottom)
        slope, bias = (b.diff.reshape(-1).copy() for b in self.layer.blobs[:2])
        return self.bottom[0].diff.copy(), slope, bias


def reference_step(x, dy, slope, bias, running_mean, running_var):
    """One BN forward/backward on the whole batch in float64, SyncBN's running-stat rule."""
    axes = (0,) + tuple(range(2, x.ndim))
    per_channel = (1, -1) + (1,) * (x.ndim - 2)
    m = x.size // x.shape[1]
    mean, var = x.mean(axis=axes), x.var(axis=axes)
    inv = 1 / np.sqrt(var + EPS)
    x_hat = (x - mean.reshape(per_channel)) * inv.reshape(per_channel)
    y = slope.reshape(per_channel) * x_hat + bias.reshape(per_channel)
    running_mean = MOMENTUM * running_mean + (1 - MOMENTUM) * mean
    running_var = MOMENTUM * running_var + (1 - MOMENTUM) * var * m / (m - 1)
    dx = (slope * inv).reshape(per_channel) * (
        dy - dy.mean(axis=axes).reshape(per_channel)
        - x_hat * (dy * x_hat).mean(axis=axes).reshape(per_channel))
    return y, dx, (dy * x_hat).sum(axis=axes), dy.sum(axis=axes), running_mean, running_var


def random_split(rs, n, parts, force_empty=False):
    """Uneven sizes summing to n, some possibly 0 (one forced to 0 when asked)."""
    cuts = np.sort(rs.randint(0, n + 1, parts - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [n]]))
    if force_empty and parts > 1 and 0 not in sizes:
        sizes[1], sizes[0] = 0, sizes[0] + sizes[1]
    return sizes


def initial_params(rs):
    return [rs.uniform(0.5, 1.5, C), rs.standard_normal(C), rs.standard_normal(C),
            rs.uniform(0.5, 2, C)]


def check_equivalence(replicas, dtype, steps=3, global_n=11, force_empty=False, seed=0,
                      data_mean=0.0, tol=None):
    rs = np.random.RandomState(seed + 97 * replicas)
    params = initial_params(rs)
    comms = ThreadComm.create(replicas)
    layers = [None] * replicas
    run_ok(lambda r: layers.__setitem__(r, Replica(comms[r], params, dtype=dtype)), replicas)
    slope, bias, running_mean, running_var = params
    for step in range(steps):
        x = (rs.standard_normal((global_n, C, 4, 5)) * rs.uniform(0.5, 3, (1, C, 1, 1))
             + data_mean + rs.uniform(-1, 1, (1, C, 1, 1))).astype(dtype)
        dy = rs.standard_normal(x.shape).astype(dtype)
        sizes = random_split(rs, global_n, replicas, force_empty and step == 0)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        pieces = [slice(bounds[r], bounds[r + 1]) for r in range(replicas)]

        def step_fn(r):
            y = layers[r].forward(x[pieces[r]])
            # what the global loss normalizer gives a replica: R x the one-device gradient
            grads = layers[r].backward(replicas * dy[pieces[r]])
            return y, grads

        outputs = run_ok(step_fn, replicas)
        y_ref, dx_ref, dslope_ref, dbias_ref, running_mean, running_var = reference_step(
            x.astype(np.float64), dy.astype(np.float64), slope, bias, running_mean, running_var)
        y = np.concatenate([o[0] for o in outputs])
        dx = np.concatenate([o[1][0] for o in outputs]) / replicas
        dslope = sum(o[1][1] for o in outputs) / replicas        # the solver's average
        dbias = sum(o[1][2] for o in outputs) / replicas
        for name, got, want in [('y', y, y_ref), ('dx', dx, dx_ref), ('dslope', dslope, dslope_ref),
                                ('dbias', dbias, dbias_ref)]:
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg='step %d %s, sizes %s'
                                       % (step, name, list(sizes)))
        for j, want in ((2, running_mean), (3, running_var)):
            stats = [rep.layer.blobs[j].data.reshape(-1) for rep in layers]
            assert all(np.array_equal(s, stats[0]) for s in stats), 'replicas\' stats differ'
            np.testing.assert_allclose(stats[0], want, rtol=tol, atol=tol, err_msg='blob %d' % j)
        assert all(o[0].shape == (sizes[r], C, 4, 5) for r, o in enumerate(outputs))


@pytest.mark.parametrize('dtype, tol', [(np.float64, 1e-10), (np.float32, 1e-5)])
@pytest.mark.parametrize('replicas', [1, 2, 3, 4])
def test_equals_one_bn_over_the_whole_batch(replicas, dtype, tol):
    check_equivalence(replicas, dtype, tol=tol)


@pytest.mark.parametrize('dtype, tol', [(np.float64, 1e-10), (np.float32, 1e-5)])
@pytest.mark.parametrize('replicas', [2, 3, 4])
def test_a_replica_with_an_empty_batch(replicas, dtype, tol):
    check_equivalence(replicas, dtype, force_empty=True, global_n=5, seed=1, tol=tol)


def test_every_replica_empty_but_one():
    check_equivalence(4, np.float64, global_n=1, tol=1e-10, seed=2)


def test_large_mean_has_no_cancellation_in_float32():
    """Mean 1e4, std ~1: float32 stays within 1e-3 of float64, from the first step on
    (running mean still 0, so the shift K is far from the data)."""
    check_equivalence(3, np.float32, steps=3, data_mean=1e4, tol=1e-3, seed=3)
    x = (np.random.RandomState(0).standard_normal(1000) + 1e4).astype(np.float32)
    naive = np.mean(x * x) - np.mean(x) ** 2           # the teeth: one-pass float32 fails
    assert abs(naive - x.astype(np.float64).var()) > 1e-3


class DtypeRecordingComm(CountingComm):
    """A CountingComm that also records the dtype of every array it allreduces."""

    def __init__(self, inner):
        super().__init__(inner)
        self.dtypes = []

    def allreduce(self, array, tag=None):
        self.dtypes.append(array.dtype)
        return super().allreduce(array, tag=tag)


#: one unit in the last place of each half type, relative: 2^-11 and 2^-8
HALF_ULP = {'float16': 2.0 ** -11, 'bfloat16': 2.0 ** -8}


@pytest.mark.parametrize('precision', ['float16', 'bfloat16'])
def test_half_blobs_on_two_replicas_keep_statistics_and_allreduces_wide(precision):
    """Mixed precision's SyncBN: half bottom and top (and their diffs), float32 params. Its
    outputs follow a float64 BN of the same half inputs over the whole batch within one
    ulp of the half type (their rounding), while the param diffs and running statistics
    follow it to float32's precision: the sums behind them are never rounded to half
    (rounding x_hat or the sums to float16 costs 1e-4 to 1e-3); the allreduces carry
    float64, the statistics blobs are float32."""
    replicas, half = 2, activation_dtype(precision)
    rs = np.random.RandomState(7)
    params = [p.astype(np.float32) for p in initial_params(rs)]
    comms = [DtypeRecordingComm(c) for c in ThreadComm.create(replicas)]
    layers = [None] * replicas
    run_ok(lambda r: layers.__setitem__(r, Replica(comms[r], params, dtype=np.float32,
                                                   activation_dtype=half)), replicas)
    slope, bias, running_mean, running_var = (p.astype(np.float64) for p in params)
    ulp = HALF_ULP[precision]
    for step in range(3):
        x = (rs.standard_normal((8, C, 4, 5)) * 2 + 3).astype(half)
        dy = rs.standard_normal(x.shape).astype(half)
        pieces = [slice(0, 3), slice(3, 8)]

        def step_fn(r):
            y = layers[r].forward(x[pieces[r]])
            return y, layers[r].backward(replicas * dy[pieces[r]])
        outputs = run_ok(step_fn, replicas)
        y_ref, dx_ref, dslope_ref, dbias_ref, running_mean, running_var = reference_step(
            x.astype(np.float64), dy.astype(np.float64), slope, bias, running_mean, running_var)
        running_mean, running_var = (s.astype(np.float32).astype(np.float64)
                                     for s in (running_mean, running_var))
        y = np.concatenate([o[0] for o in outputs])
        dx = np.concatenate([o[1][0] for o in outputs])
        assert y.dtype == half and dx.dtype == half
        for name, got, want in [('y', y, y_ref), ('dx', dx.astype(np.float64) / replicas, dx_ref)]:
            error = np.abs(got.astype(np.float64) - want)
            assert (error <= ulp * np.abs(want) + ulp * np.abs(want).max() / 64).all(), \
                'step %d %s: %g' % (step, name, error.max())
        for name, got, want in [('dslope', sum(o[1][1] for o in outputs) / replicas, dslope_ref),
                                ('dbias', sum(o[1][2] for o in outputs) / replicas, dbias_ref),
                                ('running mean', layers[0].layer.blobs[2].data, running_mean),
                                ('running var', layers[0].layer.blobs[3].data, running_var)]:
            np.testing.assert_allclose(got.reshape(-1), want, rtol=1e-5, atol=1e-5,
                                       err_msg='step %d %s' % (step, name))
    for replica in layers:
        assert [b.dtype for b in replica.layer.blobs] == [np.float32] * 4
        assert [b.diff.dtype for b in replica.layer.blobs[:2]] == [np.float32] * 2
    for comm in comms:
        assert len(comm.dtypes) == 6 and set(comm.dtypes) == {np.dtype(np.float64)}


# ----------------------------------------------------------------------------- communication

def counting_replicas(replicas, phase=TRAIN, extra=''):
    comms = [CountingComm(c) for c in ThreadComm.create(replicas)]
    params = initial_params(np.random.RandomState(5))
    nets = [None] * replicas

    def build(r):
        nets[r] = [Replica(comms[r], params, syncbn_text(name, extra), phase=phase)
                   for name in ('bn1', 'bn2')]
    run_ok(build, replicas)
    return comms, nets


def forward_backward(nets, r, x):
    for layer in nets[r]:
        layer.forward(x)
    for layer in reversed(nets[r]):
        layer.backward(np.ones_like(x))


def test_one_allreduce_per_layer_per_forward_and_per_backward():
    comms, nets = counting_replicas(2)
    x = np.random.RandomState(0).standard_normal((2, C, 4, 5))

    def fn(r):
        for layer in nets[r]:
            layer.forward(x)
        after_forward = comms[r].counts()
        for layer in reversed(nets[r]):
            layer.backward(np.ones_like(x))
        return after_forward, comms[r].counts()
    for after_forward, after_backward in run_ok(fn, 2):
        assert after_forward == {('allreduce', 'bn1'): 1, ('allreduce', 'bn2'): 1}
        assert after_backward == {('allreduce', 'bn1'): 2, ('allreduce', 'bn2'): 2}


@pytest.mark.parametrize('phase, extra',
                         [(TEST, ''), (TRAIN, 'frozen: true'), (TEST, 'frozen: true')])
def test_no_communication_in_test_or_when_frozen(phase, extra):
    comms, nets = counting_replicas(2, phase, extra)
    x = np.random.RandomState(0).standard_normal((2, C, 4, 5))
    run_ok(lambda r: forward_backward(nets, r, x), 2)
    assert all(c.calls == [] for c in comms)


def test_no_backward_collective_when_no_input_gradient_is_needed():
    comms, nets = counting_replicas(2)
    x = np.random.RandomState(0).standard_normal((2, C, 4, 5))

    def fn(r):
        layer = nets[r][0]
        layer.forward(x)
        layer.top[0].diff[...] = 1
        layer.layer.backward(layer.top, [False], layer.bottom)
        return comms[r].count('allreduce')
    assert run_ok(fn, 2) == [1, 1]


def test_a_layer_skipped_on_one_replica_is_a_clear_error():
    comms, nets = counting_replicas(2)
    x = np.random.RandomState(0).standard_normal((2, C, 4, 5))

    def fn(r):
        for layer in nets[r][r:]:          # replica 1 skips bn1
            layer.forward(x)
    _, errors = run_replicas(fn, 2)
    for e in errors:
        assert isinstance(e, CollectiveMismatch), repr(e)
        assert "'bn1'" in str(e) and "'bn2'" in str(e)


def test_a_failing_replica_releases_the_others_promptly():
    """Without the abort, replicas 1 and 2 would wait out the group's timeout (300 s) in
    their forward's allreduce, which run_replicas' watchdog calls a hang long before."""
    comms, nets = counting_replicas(3)
    x = np.random.RandomState(0).standard_normal((2, C, 4, 5))
    cause = RuntimeError('replica 0 failed before its SyncBN layer')

    def fn(r):
        if r == 0:
            time.sleep(0.3)
            comms[0].abort(cause)          # what the device pool does when a replica raises
            raise cause
        nets[r][0].forward(x)
    _, errors = run_replicas(fn, 3)
    assert errors[0] is cause
    for r in (1, 2):
        assert isinstance(errors[r], CommAborted) and errors[r].__cause__ is cause


def test_global_empty_batch_is_a_clear_error_on_every_replica():
    comms, nets = counting_replicas(2)
    _, errors = run_replicas(lambda r: nets[r][0].forward(np.zeros((0, C, 4, 5))), 2)
    assert all("layer 'bn1'" in str(e) and 'global batch is empty' in str(e) for e in errors)
