"""Asynchronous data parallelism on threads: each replica updates the shared params on its
own; the bound on staleness; what it refuses. (Across processes: tests/test_mpi.py.)"""
import threading
import time

import numpy as np
import pytest
from helpers import watchdog
from test_data_parallel import batches, solver_param

from caffe_syncbn.backend import to_numpy
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.training.solvers import get_solver


def feed(solver, data):
    items = iter(data)
    solver.set_data_source(lambda: next(items))


def slowed(solver, rank, seconds):
    """Replica ``rank`` sleeps before every forward-backward."""
    net = solver.replicas[rank]
    original = net.forward_backward

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)
    net.forward_backward = slow


def params(solver):
    return [to_numpy(b.data).copy() for b in solver.net.learnable_params]


@pytest.mark.parametrize('solver_type', ['SGD', 'Adam'])
def test_one_asynchronous_replica_trains_as_the_synchronous_solver(solver_type):
    """With one replica there is nothing to be stale about: the holder's updates are the
    synchronous solver's, bitwise (float64), statistics included."""
    data = batches(5, seed=2)
    results = []
    for mode in ('sync', 'async'):
        param = solver_param('BN')
        param.type = solver_type
        solver = get_solver(param, devices='cpu:1', dtype=np.float64, mode=mode)
        feed(solver, [{k: v[:4] for k, v in batch.items()} for batch in data])
        solver.step(5)
        results.append(params(solver) + [to_numpy(b.data).copy()
                                         for b in solver.net.params['bn']])
        solver.close()
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def run_slowed(max_staleness, iterations=8):
    """3 replicas, replica 2 ten times slower than the others."""
    solver = get_solver(solver_param('BN'), devices='cpu:3', mode='async',
                        max_staleness=max_staleness)
    rs = np.random.RandomState(0)
    lock = threading.Lock()

    def source():
        with lock:
            return {'data': rs.standard_normal((4, 3, 8, 8)),
                    'label': rs.randint(0, 5, 4).astype(float)}
    solver.set_data_source(source)
    slowed(solver, 2, 0.03)
    for rank in (0, 1):
        slowed(solver, rank, 0.003)
    solver.step(iterations)
    holder = solver.strategy.holder
    result = list(holder.clocks), holder.spread, list(holder.staleness), solver.iter
    solver.close()
    return result


def test_a_slow_replica_does_not_hold_the_others_back():
    """Unbounded: the fast replicas make most of the 24 updates of 8 iterations, and the
    slow replica's gradients are applied many updates late."""
    clocks, spread, staleness, iterations = run_slowed(None)
    assert iterations == 8 and sum(clocks) == 24
    assert clocks[2] < min(clocks[:2]) / 2, clocks
    assert max(staleness) >= 4


@pytest.mark.parametrize('bound', [0, 2])
def test_max_staleness_keeps_replicas_within_the_bound(bound):
    """A replica does not start a step while it is more than K updates ahead of the
    slowest: the counts never differ by more than K + 1 (K = 0: rounds)."""
    clocks, spread, staleness, _ = run_slowed(bound)
    assert spread <= bound + 1, clocks
    assert max(clocks) - min(clocks) <= bound + 1


def test_asynchronous_updates_learn():
    """The loss of a fixed batch falls under asynchronous updates as under synchronous ones."""
    data = batches(1, seed=4)[0]
    losses = {}
    for mode in ('sync', 'async'):
        solver = get_solver(solver_param('BN'), devices='cpu:2', dtype=np.float64, mode=mode)
        solver.set_data_source(lambda: data if mode == 'sync' else
                               {k: v[:8] for k, v in data.items()})
        first = solver.forward_backward_all() if mode == 'sync' else None
        solver.step(20)
        losses[mode] = (first, solver.smoothed_loss)
        solver.close()
    assert losses['async'][1] < 0.5 * losses['sync'][0]


def test_async_refuses_sync_bn():
    with pytest.raises(CaffeError, match='SyncBN normalizes with the statistics of all replicas'):
        get_solver(solver_param('BN'), devices='cpu:2', mode='async', sync_bn=True)
    with pytest.raises(CaffeError, match=r"-async cannot train SyncBN layers \(bn\)"):
        get_solver(solver_param('SyncBN'), devices='cpu:2', mode='async')
    with pytest.raises(CaffeError, match='needs -async'):
        get_solver(solver_param('BN'), devices='cpu:2', max_staleness=1)


def test_async_refuses_a_nan_effect():
    """There is no iteration before which to stop: updates apply as they arrive."""
    solver = get_solver(solver_param('BN'), devices='cpu:2', mode='async')
    try:
        solver.nan_effect = 'stop'
        with pytest.raises(CaffeError, match='-nan_effect stop needs synchronous updates'):
            solver.step(1)
    finally:
        solver.close()


def test_a_failing_asynchronous_replica_raises_the_original_error():
    solver = get_solver(solver_param('BN'), devices='cpu:2', mode='async')
    feed(solver, batches(50))
    net = solver.replicas[1]
    original, calls = net.forward_backward, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError('replica 1 broke')
        return original(*args, **kwargs)
    net.forward_backward = failing
    with pytest.raises(ValueError, match='replica 1 broke'):
        watchdog.call(lambda: solver.step(20), 'the replicas after one failed')
    solver.close()


def test_async_from_the_command_line(tmp_path):
    """-async trains and snapshots; -async with -sync_bn is one error line."""
    from test_train_net import make_job, run_tool
    solver = make_job(tmp_path, 2, max_iter=4)
    result = run_tool('-solver', solver, '-cpu_devices', '2', '-async', '-max_staleness', '1')
    assert result.returncode == 0, result.stderr
    assert (tmp_path / 'snap_iter_4.caffemodel').exists()
    assert 'Asynchronous updates: 8, staleness' in result.stderr
    result = run_tool('-solver', solver, '-cpu_devices', '2', '--async', '--sync-bn')
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith('error: -async cannot run with '
                                                             '-sync_bn')
