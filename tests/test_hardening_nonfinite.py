"""-nan_effect watches every value a run keeps (issue 34, item 2): the loss, the gradients,
the learned params and the running statistics; a run it stops exits 3, with the snapshot
of the weights before the fault, and never a snapshot holding one that is not finite."""
import logging
import os
import re
import sys

import numpy as np
import pytest
from test_train_net import make_job

import caffe_syncbn as caffe
from caffe_syncbn.formats.solverstate import read_solver_state

from helpers import watchdog
from helpers.paths import ROOT


def run_cli(*args):
    return watchdog.run([sys.executable, '-m', 'caffe_syncbn', *map(str, args)],
                        env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                        text=True, limit=600)


def all_finite(net):
    return all(np.isfinite(b.data).all() for blobs in net.params.values() for b in blobs)


def test_a_running_variance_that_overflows_stops_the_run_with_exit_status_3(tmp_path):
    """The issue's run: base_lr 1e12 on 4 devices. The loss stays finite (SoftmaxWithLoss
    clamps it) while BatchNorm's variance overflows; the run ended 'Optimization Done.',
    exit 0, with inf in its snapshot."""
    solver = make_job(tmp_path, batch=2, max_iter=10, rows=64)
    solver.write_text(solver.read_text().replace('base_lr: 0.05', 'base_lr: 1e12'))
    result = run_cli('train', '-solver', solver, '-cpu_devices', 4, '-nan_effect', 'stop')
    assert result.returncode == 3, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith('W')]
    assert len(warnings) == 1 and re.search(
        r"\] Iteration (\d+): the running statistics of layer 'bn' \(param 1\) are not finite "
        r'\(first time\); training stops before this update, as on a stop signal$',
        warnings[0]), warnings
    stopped_at = int(re.search(r'Iteration (\d+):', warnings[0]).group(1))
    assert 'Optimization stopped early.' in result.stderr
    assert 'Optimization Done.' not in result.stderr
    snapshots = sorted(tmp_path.glob('snap_iter_*.caffemodel'))
    assert [p.name for p in snapshots] == ['snap_iter_%d.caffemodel' % stopped_at]
    net = caffe.Net(str(tmp_path / 'net.prototxt'), caffe.TEST, weights=str(snapshots[0]))
    assert all_finite(net)
    state = read_solver_state(str(tmp_path / ('snap_iter_%d.solverstate' % stopped_at)))
    assert state.iter == stopped_at


OVERFLOW = '''name: "overflow"
layer { name: "in" type: "Input" top: "x" top: "t"
        input_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 2 weight_filler { type: "constant" value: 0.1 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss" }
'''


@pytest.mark.filterwarnings('ignore::RuntimeWarning')
@pytest.mark.parametrize('effect', ['stop', 'snapshot'])
def test_weights_that_an_update_overflows_are_named_and_never_snapshotted(tmp_path, records,
                                                                           effect):
    """Finite gradients, an update past float32's range: the weights are inf after it, and
    the next pass's loss is NaN. The warning names the weights, not the loss, and no
    snapshot holds them (was: the NaN loss 'snapshotted the weights before this update',
    which were already inf)."""
    (tmp_path / 'net.prototxt').write_text(OVERFLOW)
    (tmp_path / 'solver.prototxt').write_text(
        'net: "%s"\nbase_lr: 1e37 lr_policy: "fixed" max_iter: 3 display: 0\n'
        'snapshot_prefix: "%s"\n' % (tmp_path / 'net.prototxt', tmp_path / 'snap'))
    solver = caffe.get_solver(str(tmp_path / 'solver.prototxt'))
    solver.set_data_source(lambda: {'x': np.full((4, 3), 10.0), 't': np.full((4, 2), 100.0)})
    solver.nan_effect = effect
    solver.solve()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert warnings == ["Iteration 1: the weights of layer 'ip' (param 0) are not finite (first "
                        'time); the last update made them so from finite gradients (is the '
                        'learning rate too high?)' + {
                            'stop': '; training stops, without a snapshot of them',
                            'snapshot': ', so no snapshot can hold the weights before it; '
                                        'training goes on'}[effect]], warnings
    assert list(tmp_path.glob('snap_*')) == []
    assert solver.stopped_on_non_finite == (effect == 'stop')


def test_a_non_finite_running_statistic_is_found_in_one_read_and_put_back(records):
    """Running statistics (lr_mult 0) are watched as the pass left them, and with 'stop'
    put back as they were before it: the snapshot holds the statistics before the fault."""
    from test_data_parallel import batches, solver_param
    solver = caffe.get_solver(solver_param('BatchNorm'))
    data = batches(2)
    calls = iter(range(10))

    def source():
        batch = dict(data[0])
        if next(calls) == 1:                       # the second pass: a huge input
            batch['data'] = batch['data'] * 1e30
        return batch
    solver.set_data_source(source)
    solver.nan_effect = 'stop'
    solver.step(1)
    before = [b.data.copy() for b in solver.net.params['bn']]
    solver.step(1)
    assert solver.iter == 1 and solver.stopped_on_non_finite
    message = [r.getMessage() for r in records if r.levelno == logging.WARNING][-1]
    assert message.startswith("Iteration 1: the running statistics of layer 'bn' (param 1) are "
                              'not finite'), message
    for blob, old in zip(solver.net.params['bn'], before):
        np.testing.assert_array_equal(blob.data, old)
