"""-sync_bn_group_size K (issue 33, item 1) in a solver: its two limits, K = 1 (per-device
batch norm) and K = N (SyncBN over every replica), its one-line refusals and its log lines.
tests/layers/test_norm_syncbn_groups.py holds each group to a float64 batch norm of its
batch; tests/test_mpi.py places groups across processes."""
import numpy as np
import pytest
from helpers.emulated_gpu import emulated_gpu
from test_cli import one_error_line, run_cli
from test_data_parallel import batches, solver_param
from test_train_net import make_job

from caffe_syncbn.backend import to_numpy
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.training.solvers import get_solver

STEPS = 4


def train(bn, group_size=None, devices='cpu:4', dtype=np.float64):
    """STEPS steps on an even split of 4 x 4 images: every replica's learned params and its
    BN's running mean and variance."""
    with get_solver(solver_param(bn), devices=devices, dtype=dtype,
                    sync_bn_group_size=group_size) as solver:
        feed = iter(batches(STEPS, seed=7))
        solver.set_data_source(lambda: next(feed))
        solver.step(STEPS)
        learned = [[to_numpy(b.data).copy() for b, lr in zip(net.learnable_params, net.params_lr)
                    if lr] for net in solver.replicas]
        running = [[to_numpy(b.data).reshape(-1).copy() for b in net.params['bn'][2:]]
                   for net in solver.replicas]
    return learned, running


def test_groups_of_all_replicas_are_syncbn_bitwise():
    """K = N: the communicator of every replica itself, so bitwise today's SyncBN."""
    syncbn, grouped = train('SyncBN'), train('SyncBN', group_size=4)
    for a, b in zip(syncbn[0] + syncbn[1], grouped[0] + grouped[1]):
        for x, y in zip(a, b):
            assert np.array_equal(x, y)


def test_groups_of_one_are_per_device_batch_norm():
    """K = 1 against the forks' BN on each device (no exchange at all): the same learned
    params and running means on every replica, and each replica's running variance
    m / (m - 1) times BN's (SyncBN keeps the unbiased variance, BN the biased one; m = 4
    images x 8 x 8 positions). Replicas normalize with their own batches, so their
    running statistics differ."""
    alone, per_device = train('SyncBN', group_size=1), train('BN')
    m = 4 * 8 * 8
    for replica in range(4):
        for a, b in zip(alone[0][replica], per_device[0][replica]):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)
        (mean, var), (bn_mean, bn_var) = alone[1][replica], per_device[1][replica]
        np.testing.assert_allclose(mean, bn_mean, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(var, bn_var * m / (m - 1), rtol=1e-9)
    assert not np.allclose(alone[1][0][0], alone[1][1][0])
    syncbn = train('SyncBN')             # the teeth: all replicas' statistics are another thing
    assert not np.allclose(alone[0][0][0], syncbn[0][0][0], rtol=1e-6, atol=1e-6)


def test_groups_of_two_keep_statistics_per_group_and_gradients_over_all():
    """K = 2 of 4: the replicas of a group hold bitwise the same running statistics, the
    two groups different ones, and the learned params, averaged over all 4, stay equal."""
    learned, running = train('SyncBN', group_size=2)
    for replica in range(1, 4):
        assert all(np.array_equal(a, b) for a, b in zip(learned[replica], learned[0]))
    assert all(np.array_equal(a, b) for a, b in zip(running[0], running[1]))
    assert all(np.array_equal(a, b) for a, b in zip(running[2], running[3]))
    assert not np.allclose(running[0][0], running[2][0])


@pytest.mark.parametrize('devices, group_size', [('gpu:0,0,0,0', 2), ('gpu:0,1,2,3', 2),
                                                 ('gpu:0,1,2,3', 1)])
def test_groups_on_the_emulated_gpu_equal_the_cpu(monkeypatch, devices, group_size):
    """Groups of replicas sharing a GPU (SameDeviceComm) and of distinct GPUs (NCCL, whose
    group members issue their kernels on the stream of the member of all replicas: one order
    per GPU) train as on CPU threads."""
    emulated_gpu(monkeypatch, devices=4)
    cpu = train('SyncBN', group_size, dtype=np.float32)
    gpu = train('SyncBN', group_size, devices=devices, dtype=np.float32)
    for mine, theirs in zip(cpu[0] + cpu[1], gpu[0] + gpu[1]):
        for a, b in zip(mine, theirs):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_nccl_groups_run_on_the_side_stream_of_all_replicas(monkeypatch):
    emulated_gpu(monkeypatch, devices=4)
    with get_solver(solver_param(), devices='gpu:0,1,2,3', sync_bn_group_size=2) as solver:
        replication = solver.replication
        for group, full in zip(replication.group_comms, replication.comms):
            assert group.size == 2 and full.size == 4
            assert group.side_stream() is full.side_stream()


@pytest.mark.parametrize('kwargs, words', [
    (dict(sync_bn_group_size=3), 'sync_bn_group_size 3: it must divide the number of replicas, 4'),
    (dict(sync_bn_group_size=2, mode='async'), '-async cannot run with -sync_bn_group_size')])
def test_a_group_size_that_cannot_be_is_one_error(kwargs, words):
    with pytest.raises(CaffeError, match=words):
        get_solver(solver_param('BN'), devices='cpu:4', **kwargs)


def test_the_command_names_the_groups_and_their_cost(tmp_path):
    solver = make_job(tmp_path, batch=2, max_iter=1)
    result = run_cli('train', '-solver', solver, '-cpu_devices', 4, '-sync_bn',
                     '-sync_bn_group_size', 2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ('SyncBN: 1 layer(s) share batch statistics over groups of 2 replicas; per '
            'iteration each replica reduces 2 buffers, 136 bytes, with the 1 other replica of '
            'its group') in result.stderr
    assert '] SyncBN group 0: replicas 0-1 (threads of this process)' in result.stderr
    assert '] SyncBN group 1: replicas 2-3 (threads of this process)' in result.stderr
    bad = run_cli('train', '-solver', solver, '-cpu_devices', 4, '-sync_bn',
                  '-sync_bn_group_size', 3)
    assert 'sync_bn_group_size 3: it must divide the number of replicas, 4' in one_error_line(bad)
