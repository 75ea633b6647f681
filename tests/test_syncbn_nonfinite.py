"""A batch whose statistics are not finite cannot poison SyncBN's running statistics
(issue 33, item 3): every replica of the group skips the update alike, the log says so at
the iteration and counts the skips at the end, and -nan_effect sees it. On the emulated
GPU the skip is decided on the device, and the iteration reads the device no more."""
import logging
import os
import re
import sys

import numpy as np
import pytest
from helpers import watchdog
from helpers.emulated_gpu import emulated_gpu
from helpers.paths import ROOT
from test_data_parallel import batches, solver_param

from caffe_syncbn import caffe_pb2
from caffe_syncbn.backend import to_numpy
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.training.solvers import get_solver

POISONED_STEP = 2


def warnings_of(records):
    return [r.getMessage() for r in records if r.levelno == logging.WARNING]


def poisoned_source(replicas, poisoned_replica, steps):
    """The global batches of test_data_parallel split evenly, with a NaN in the data of
    ``poisoned_replica`` at POISONED_STEP."""
    feed = iter(batches(steps, seed=4))
    step = {'n': 0}

    def source():
        batch = {k: v.copy() for k, v in next(feed).items()}
        if step['n'] == POISONED_STEP:
            rows = 16 // replicas
            batch['data'][poisoned_replica * rows, 1, 2, 3] = np.nan
        step['n'] += 1
        return batch
    return source


def running(solver):
    return [[to_numpy(b.data).copy() for b in net.params['bn'][2:]] for net in solver.replicas]


def stepping(solver, steps):
    """The running statistics of every replica before each of ``steps`` steps, and after."""
    seen = []
    for _ in range(steps):
        seen.append(running(solver))
        solver.step(1)
    return seen + [running(solver)]


@pytest.mark.filterwarnings('ignore::RuntimeWarning')
@pytest.mark.parametrize('group_size, kept', [(None, [0, 1, 2, 3]), (2, [2, 3])])
def test_a_nan_batch_on_one_replica_of_four_leaves_the_running_statistics(records, group_size,
                                                                          kept):
    """Replica 2 of 4 reads a NaN at iteration 2: after that iteration every replica of its
    group (all 4, or replicas 2 and 3 in groups of 2) holds bitwise the running statistics
    it held before, one warning names the layer and the iteration, and the count is 1. (The
    update itself is NaN, as in Caffe: -nan_effect is 'none'.)"""
    with get_solver(solver_param(), devices='cpu:4', dtype=np.float64,
                    sync_bn_group_size=group_size) as solver:
        solver.set_data_source(poisoned_source(4, 2, 3))
        seen = stepping(solver, 3)
        assert solver._non_finite.skipped == {'bn': 1}
    before, after = seen[POISONED_STEP], seen[POISONED_STEP + 1]
    for replica in range(4):
        same = all(np.array_equal(a, b) for a, b in zip(before[replica], after[replica]))
        assert same == (replica in kept), replica
        assert all(np.isfinite(a).all() for a in after[replica])
    skips = [w for w in warnings_of(records) if 'kept its running statistics' in w]
    which = '' if group_size is None else ' in 1 of its 2 updates (one per group and pass)'
    assert skips[0] == ("Iteration 2: layer 'bn' kept its running statistics%s: the "
                        'statistics of the batch are not finite' % which)


BRANCH = '''
layer { name: "in" type: "Input" top: "x" top: "t" top: "aux"
        input_param { shape { dim: 8 dim: 3 } shape { dim: 8 dim: 2 } shape { dim: 8 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 2 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss" }
layer { name: "bn" type: "SyncBN" bottom: "aux" top: "normed" bn_param { momentum: 0.9 } }
'''


@pytest.mark.filterwarnings('ignore::RuntimeWarning')
def test_nan_effect_stop_sees_a_skipped_update_when_all_else_is_finite(records):
    """A SyncBN on a branch the loss does not read: a NaN there leaves the loss and the
    gradients finite, and only the skipped update tells. -nan_effect stop stops before the
    update of iteration 2, naming the layer, with its statistics finite (before, they were
    NaN, and the check named them); the end of the run counts the one skipped update."""
    param = solver_param()
    param.net_param.CopyFrom(parse_text(BRANCH, caffe_pb2.NetParameter()))
    param.max_iter, param.snapshot_after_train = 5, False
    rs = np.random.RandomState(0)
    step = {'n': 0}

    def source():
        batch = {'x': rs.standard_normal((8, 3)), 't': rs.standard_normal((8, 2)),
                 'aux': rs.standard_normal((8, 3))}
        if step['n'] == POISONED_STEP:
            batch['aux'][5, 1] = np.nan          # replica 2's second row
        step['n'] += 1
        return batch
    with get_solver(param, devices='cpu:4', dtype=np.float64) as solver:
        solver.nan_effect = 'stop'
        solver.set_data_source(source)
        solver.solve()
        assert solver.iter == POISONED_STEP and solver.stopped_on_non_finite
        assert all(np.isfinite(to_numpy(b.data)).all() for net in solver.replicas
                   for b in net.params['bn'])
    assert warnings_of(records) == [
        "Iteration 2: layer 'bn' kept its running statistics: the statistics of the batch are "
        'not finite',
        "Iteration 2: the batch statistics of layer 'bn' (which kept its running statistics) "
        'are not finite (first time); training stops before this update, as on a stop signal',
        "1 update(s) of running statistics skipped because the statistics of the batch were not "
        "finite: 'bn' 1"]


@pytest.mark.filterwarnings('ignore::RuntimeWarning')
def test_on_the_gpu_the_skip_is_decided_on_the_device_within_the_pass_reads(monkeypatch):
    """gpu:0,0 (the emulated GPU): the NaN of replica 1 keeps both replicas' statistics and
    the count is 1; the passes of the iteration that skips read the device as often as
    those of one that does not, once per replica: the flag comes with the pass's loss."""
    gpu = emulated_gpu(monkeypatch)
    with get_solver(solver_param(), devices='gpu:0,0') as solver:
        solver.set_data_source(poisoned_source(2, 1, 3))
        reads, passes = [], solver.strategy.forward_backward_all

        def counted():                   # the passes' reads, not the -nan_effect search's
            before = gpu.order.host_reads
            loss = passes()
            reads.append(gpu.order.host_reads - before)
            return loss
        solver.strategy.forward_backward_all = counted
        seen = stepping(solver, 3)
        assert solver._non_finite.skipped == {'bn': 1}
    assert reads[0] == reads[1] == reads[2] == 2, reads       # one per replica
    for replica in range(2):
        assert all(np.array_equal(a, b) for a, b in zip(seen[2][replica], seen[3][replica]))
        assert not all(np.array_equal(a, b) for a, b in zip(seen[1][replica], seen[2][replica]))


def test_the_benchmark_of_the_check_runs_as_a_user_runs_it():
    result = watchdog.run([sys.executable, str(ROOT / 'benchmarks' / 'syncbn_checks.py'),
                           '--repeats', '8'], capture_output=True, text=True, limit=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r'demo net \(fcn_bn, -sync_bn\): 6 SyncBN layers, the check adds '
                     r'-?[\d.]+ ms per replica and iteration', result.stdout), result.stdout

