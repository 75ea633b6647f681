"""Mixed precision (issue 33, item 2): activations and their diffs in float16 or bfloat16,
params, updates, batch-norm statistics and allreduces in float32, with float16's dynamic
loss scale; float32 (and float64) runs are the reference."""
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
from test_train_net import make_job, run_tool

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.backend import to_numpy
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.formats.caffemodel import read_net_param
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.precision import activation_dtype
from caffe_syncbn.training.solvers import get_solver

from helpers import watchdog

NET = '''
name: "mixed"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 16 dim: 3 dim: 8 dim: 8 } shape { dim: 16 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 bias_term: false
                            weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv"
        batch_norm_param { moving_average_fraction: 0.9 } }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" top: "argmax"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" }
'''
SOLVER = ('base_lr: 0.05 momentum: 0.9 weight_decay: 0.0005 lr_policy: "fixed" max_iter: 100 '
          'display: 0 random_seed: 5')
#: one unit in the last place of each half type, relative: 2^-11 and 2^-8
ULP = {'float16': 2.0 ** -11, 'bfloat16': 2.0 ** -8}


def solver_param(loss_weight=None):
    param = parse_text(SOLVER, caffe_pb2.SolverParameter())
    param.net_param.CopyFrom(parse_text(NET, caffe_pb2.NetParameter()))
    if loss_weight is not None:
        (loss,) = [layer for layer in param.net_param.layer if layer.name == 'loss']
        loss.loss_weight.append(loss_weight)
    return param


def batches(steps, seed=0):
    """Batches a net can learn: channel 0 carries the label."""
    rs = np.random.RandomState(seed)
    out = []
    for _ in range(steps):
        label = rs.randint(0, 4, 16)
        data = rs.standard_normal((16, 3, 8, 8))
        data[:, 0] += label[:, None, None] - 1.5
        out.append({'data': data, 'label': label.astype(np.float64)})
    return out


def train(precision, devices='cpu:1', dtype=None, steps=20, loss_scale=2.0 ** 12):
    """``steps`` iterations with -sync_bn; (losses, params before, params after, running
    statistics, the solver's LossScale). The float16 scale starts at ``loss_scale``, where
    no gradient of this net overflows, so that every run makes every update."""
    solver = get_solver(solver_param(), devices=devices, precision=precision, dtype=dtype,
                        sync_bn=True)
    solver.loss_scale.value = min(solver.loss_scale.value, loss_scale)
    before = [to_numpy(b.data).astype(np.float64) for b in solver.net.learnable_params]
    data = iter(batches(steps))
    solver.set_data_source(lambda: next(data))
    losses = []
    for _ in range(steps):
        solver.step(1)
        losses.append(float(solver.smoothed_loss))
    after = [[to_numpy(b.data).astype(np.float64) for b in net.learnable_params]
             for net in solver.replicas]
    stats = [to_numpy(b.data).astype(np.float64) for b in solver.net.params['bn'][2:]]
    solver.close()
    return np.array(losses), before, after, stats, solver.loss_scale


def deviation(run, reference):
    """The largest difference of ``run``'s params from ``reference``'s, relative to the
    largest change ``reference`` made to that param."""
    _, before, after, _, _ = reference
    return max(float(np.abs(mine - theirs).max() / np.abs(theirs - start).max())
               for mine, theirs, start in zip(run[2][0], after[0], before)
               if np.abs(theirs - start).max() > 0)


@pytest.fixture(scope='module')
def float64_run():
    return train('float32', dtype=np.float64)


@pytest.mark.parametrize('precision', ['float16', 'bfloat16'])
def test_losses_and_params_follow_float32_within_a_few_ulps_of_the_half_type(
        precision, float64_run):
    """20 steps of a stable run against float64. Each gradient comes from activations and
    diffs rounded to the half type: its relative error is a few of the type's ulps (the
    roundings of the half-dozen layers it passes through); a step's update has the error
    of its gradient, and over 20 steps those add up with random signs. So the losses stay
    within 4 ulps, and the params within 24 ulps of the change the steps made (measured:
    1 and 3 ulps in float16, 1.5 and 8 in bfloat16). float32, held to the same reference,
    deviates a thousand times less: the half type is in effect, and the test has teeth."""
    run = train(precision)
    assert run[4].skipped == 0
    reference_losses = float64_run[0]
    ulp = ULP[precision]
    assert np.abs(run[0] - reference_losses).max() <= 4 * ulp * np.abs(reference_losses).max()
    assert deviation(run, float64_run) <= 24 * ulp
    float32 = train('float32')
    assert deviation(float32, float64_run) < deviation(run, float64_run) / 100
    assert run[0][-1] < run[0][0] * 0.5            # and it learns


def test_syncbn_on_four_devices_in_float16_follows_float32():
    """SyncBN's sums travel in float64 whatever the activations: four float16 replicas
    keep bitwise equal params and statistics, and follow four float32 replicas as one
    float16 device follows one float32 device (the test above)."""
    float32 = train('float32', devices='cpu:4')
    float16 = train('float16', devices='cpu:4')
    assert float16[4].skipped == 0
    assert np.abs(float16[0] - float32[0]).max() <= 4 * ULP['float16'] * np.abs(float32[0]).max()
    assert deviation(float16, float32) <= 24 * ULP['float16']
    for mine, theirs in zip(float16[3], float32[3]):      # mean_sum, var_sum, factor
        assert np.abs(mine - theirs).max() <= 8 * ULP['float16'] * np.abs(theirs).max()
    for replica in float16[2][1:]:
        for mine, root in zip(replica, float16[2][0]):
            assert np.array_equal(mine, root)


@pytest.mark.parametrize('precision', ['float16', 'bfloat16'])
def test_activations_are_half_and_params_inputs_labels_losses_indices_float32(precision):
    net = caffe.Net(parse_text(NET, caffe_pb2.NetParameter()), caffe.TRAIN, precision=precision)
    half, full = activation_dtype(precision), np.dtype(np.float32)
    net.blobs['data'].data[...] = batches(1)[0]['data']
    net.blobs['label'].data[...] = batches(1)[0]['label']
    net.forward_backward()
    for name in ('conv', 'pool', 'ip'):
        assert net.blobs[name].data.dtype == half and net.blobs[name].diff.dtype == half, name
    for name in ('data', 'label', 'argmax', 'loss', 'accuracy'):
        assert net.blobs[name].data.dtype == full, name
    for blob in net.learnable_params:
        assert blob.data.dtype == full and blob.diff.dtype == full
    # the activations take half the bytes
    float32 = caffe.Net(parse_text(NET, caffe_pb2.NetParameter()), caffe.TRAIN)
    assert net.blobs['conv'].data.nbytes * 2 == float32.blobs['conv'].data.nbytes


def overflowing_solver(loss_weight=None, **kwargs):
    solver = get_solver(solver_param(loss_weight), precision='float16', **kwargs)
    data = iter(batches(20))
    solver.set_data_source(lambda: next(data))
    return solver


def test_an_overflow_skips_the_update_halves_the_scale_and_says_why(caplog):
    """A scale of 2^30 makes the diffs of the backward overflow float16: the update is
    skipped (learned params and momentum as they were; the forward's running statistics
    count, as in any forward), the iteration counts, the scale halves, and the log says
    so; at a scale that fits, the updates go on."""
    caplog.set_level(logging.INFO, logger='caffe_syncbn')
    solver = overflowing_solver()
    solver.step(1)                                        # momentum to keep
    params = [b.data.copy() for b in solver.net.learnable_params]
    history = [h.copy() for h in solver.rule.history]
    solver.loss_scale.value = 2.0 ** 30
    solver.step(1)
    assert solver.iter == 2 and solver.loss_scale.skipped == 1
    assert solver.loss_scale.value == 2.0 ** 29
    learned = [lr != 0 for lr in solver.net.params_lr]
    for before, blob, lr in zip(params, solver.net.learnable_params, solver.net.params_lr):
        assert np.array_equal(before, blob.data) == (lr != 0)
    assert 0 < sum(learned) < len(learned)
    for before, now in zip(history, solver.rule.history):
        assert np.array_equal(before, now)
    skipped = [r.getMessage() for r in caplog.records if ': update skipped' in r.getMessage()]
    assert skipped == ['Iteration 1: update skipped (1 so far): the gradients are not finite at '
                       'loss scale 1.07374e+09 (a float16 diff overflowed); loss scale now '
                       '5.36871e+08']
    assert all(r.levelname == 'WARNING' for r in caplog.records
               if ': update skipped' in r.getMessage())
    solver.loss_scale.value = 2.0 ** 10
    solver.step(1)
    assert solver.loss_scale.skipped == 1
    assert not np.array_equal(params[0], solver.net.learnable_params[0].data)
    assert not any('not finite (first time)' in r.getMessage() for r in caplog.records)
    solver.close()


def test_the_scale_doubles_after_growth_interval_updates_without_an_overflow(caplog):
    caplog.set_level(logging.INFO, logger='caffe_syncbn')
    solver = overflowing_solver()
    solver.loss_scale.value, solver.loss_scale.growth_interval = 256.0, 3
    solver.step(7)
    assert solver.loss_scale.value == 1024.0 and solver.loss_scale.skipped == 0
    assert [r.getMessage() for r in caplog.records if 'raised' in r.getMessage()] == [
        'Iteration %d: loss scale raised to %d after 3 updates without an overflow' % (i, v)
        for i, v in ((2, 512), (5, 1024))]
    solver.close()


def test_the_default_scale_finds_its_level_in_a_few_skipped_updates():
    """Four replicas divide the loss by their share of the global batch, so each one's
    diffs are four times one device's, and a loss weight of 8 makes them 8 times larger
    again: at 2^16 the scores' diffs pass float16's range (at 2^13 they reach 16000), and
    the scale halves until they do not; then every update goes through."""
    solver = overflowing_solver(loss_weight=8, devices='cpu:4', sync_bn=True)
    solver.step(12)
    skipped = solver.loss_scale.skipped
    assert 1 <= skipped <= 4 and solver.loss_scale.value == 2.0 ** (16 - skipped)
    solver.close()


def test_bfloat16_and_float32_keep_a_scale_of_1_and_skip_nothing():
    for precision in ('bfloat16', 'float32'):
        solver = get_solver(solver_param(), precision=precision)
        assert solver.loss_scale.value == 1.0 and not solver.loss_scale.dynamic
        data = iter(batches(2))
        solver.set_data_source(lambda: next(data))
        solver.step(2)
        assert solver.loss_scale.skipped == 0
        solver.close()


def test_refusals_are_one_line():
    with pytest.raises(CaffeError, match=r"^-precision float64: expected one of float32, "
                                         r"float16, bfloat16$"):
        get_solver(solver_param(), precision='float64')
    with pytest.raises(CaffeError, match=r'^-precision float16 keeps the params in float32, '
                                         r'not float64$'):
        get_solver(solver_param(), precision='float16', dtype=np.float64)
    with pytest.raises(CaffeError, match='^-precision bfloat16 needs synchronous updates'):
        get_solver(solver_param(), devices='cpu:2', mode='async', precision='bfloat16')


# ---- the command line and the files -------------------------------------------------------
def test_train_precision_float16_logs_it_and_snapshots_float32_caffe_files(tmp_path):
    """`-precision float16` on two devices: the log names the precision and the scale, and
    the snapshot's caffemodel and solverstate hold float32 blobs (BlobProto.data, not
    double_data), which any Caffe reads."""
    solver = make_job(tmp_path, batch=4, max_iter=4)
    result = run_tool('--solver', solver, '--cpu-devices', 2, '--sync-bn', '--precision',
                      'float16', limit=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r'\] Mixed precision float16: activations and their diffs in float16; '
                     r'params, updates, batch-norm statistics and allreduces in float32; '
                     r'dynamic loss scale 65536 ', result.stderr)
    model = read_net_param(str(tmp_path / 'snap_iter_4.caffemodel'))
    blobs = [blob for layer in model.layer for blob in layer.blobs]
    assert blobs and all(len(b.data) > 0 and not len(b.double_data) for b in blobs)
    net = caffe.Net(str(tmp_path / 'net.prototxt'), caffe.TEST,
                    weights=str(tmp_path / 'snap_iter_4.caffemodel'))
    assert all(np.isfinite(b.data).all() and b.data.dtype == np.float32
               for blobs in net.params.values() for b in blobs)
    state = caffe_pb2.SolverState.FromString((tmp_path / 'snap_iter_4.solverstate').read_bytes())
    assert state.iter == 4 and all(len(h.data) and not len(h.double_data) for h in state.history)


def test_train_refuses_an_unknown_precision_in_one_line(tmp_path):
    result = run_tool('--solver', make_job(tmp_path, batch=4), '--precision', 'half')
    assert result.returncode != 0
    assert "invalid choice: 'half'" in result.stderr and 'Traceback' not in result.stderr


BVLC_PYTHON = Path.home() / 'caffe-ref' / 'caffe' / 'python'
LOAD_IN_BVLC = '''
import sys, numpy as np, caffe
net = caffe.Net(sys.argv[1], sys.argv[2], caffe.TEST)
np.savez(sys.argv[3], **{'%s/%d' % (name, i): b.data for name, blobs in net.params.items()
                         for i, b in enumerate(blobs)})
'''


@pytest.mark.skipif(not (BVLC_PYTHON / 'caffe' / '_caffe.so').exists(),
                    reason='BVLC Caffe with pycaffe not built at ~/caffe-ref '
                           '(shared/tools/build_ref_caffe.sh)')
def test_a_float16_snapshot_loads_in_bvlc_caffe(tmp_path):
    """Stock Caffe's pycaffe reads the snapshot of a float16 run, BatchNorm's statistics
    included, and holds the same float32 values as we do."""
    solver = make_job(tmp_path, batch=4, max_iter=3)
    result = run_tool('--solver', solver, '--cpu-devices', 2, '--sync-bn', '--precision',
                      'float16', limit=300)
    assert result.returncode == 0, result.stderr[-3000:]
    weights = tmp_path / 'snap_iter_3.caffemodel'
    loaded = watchdog.run(['python3', '-c', LOAD_IN_BVLC, str(tmp_path / 'net.prototxt'),
                           str(weights), str(tmp_path / 'bvlc.npz')],
                          env=dict(os.environ, PYTHONPATH=str(BVLC_PYTHON), GLOG_minloglevel='2'),
                          capture_output=True, text=True, limit=120)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    theirs = np.load(tmp_path / 'bvlc.npz')
    ours = caffe.Net(str(tmp_path / 'net.prototxt'), caffe.TEST, weights=str(weights))
    assert sorted(theirs.files) == sorted('%s/%d' % (name, i) for name, blobs in
                                          ours.params.items() for i in range(len(blobs)))
    for key in theirs.files:
        name, index = key.rsplit('/', 1)
        assert np.array_equal(theirs[key], ours.params[name][int(index)].data), key
