"""Solvers: lr policies and update rules against float64 references of Caffe's formulas,
the driver on a small quadratic net, solverstate files, and the golden solver trajectories."""
import json
import logging
import math
import pickle

import numpy as np
import pytest

from caffe_syncbn import caffe_pb2
from caffe_syncbn.blob import Blob
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layer import LayerContext
from caffe_syncbn.memory_planner import MEMORY_PLANS
from caffe_syncbn.training.rules import RULES
from caffe_syncbn.formats.solverstate import SolverState, read_solver_state, write_solver_state
from caffe_syncbn.netparam.solver_param import load_solver_param
from caffe_syncbn.pycaffe.caffe import get_solver
from caffe_syncbn.training.lr_policy import LearningRatePolicy
from caffe_syncbn.training.solver import Solver
from caffe_syncbn.training.solvers import get_solver_class

from helpers.paths import GOLDEN, require


def solver_param(**fields):
    param = caffe_pb2.SolverParameter()
    for key, value in fields.items():
        if isinstance(value, (list, tuple)):
            getattr(param, key).extend(value)
        else:
            setattr(param, key, value)
    return param


# ---- learning-rate policies -----------------------------------------------------------------
def reference_rate(p, it):
    base, gamma, power = p.base_lr, p.gamma, p.power
    return {
        'fixed': lambda: base,
        'step': lambda: base * gamma ** (it // p.stepsize),
        'exp': lambda: base * gamma ** it,
        'inv': lambda: base * (1 + gamma * it) ** -power,
        'multistep': lambda: base * gamma ** sum(it >= s for s in p.stepvalue),
        'poly': lambda: base * (1 - it / p.max_iter) ** power,
        'sigmoid': lambda: base / (1 + math.exp(-gamma * (it - p.stepsize))),
    }[p.lr_policy]()


POLICY_CASES = [
    dict(lr_policy='fixed', base_lr=0.1),
    dict(lr_policy='step', base_lr=0.1, gamma=0.5, stepsize=4),
    dict(lr_policy='exp', base_lr=0.1, gamma=0.95),
    dict(lr_policy='inv', base_lr=0.01, gamma=1e-4, power=0.75),
    dict(lr_policy='multistep', base_lr=0.1, gamma=0.3, stepvalue=[3, 7, 10]),
    dict(lr_policy='poly', base_lr=0.1, power=1.5, max_iter=30),
    dict(lr_policy='sigmoid', base_lr=0.1, gamma=0.5, stepsize=6),
]


@pytest.mark.parametrize('fields', POLICY_CASES, ids=[c['lr_policy'] for c in POLICY_CASES])
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_lr_policy_matches_formula(fields, dtype):
    p = solver_param(**fields)
    policy = LearningRatePolicy(p, dtype)
    for it in range(30):
        rate = policy.rate(it)
        assert rate.dtype == dtype
        np.testing.assert_allclose(float(rate), reference_rate(p, it), rtol=1e-5 if dtype == np.float32 else 1e-9)


def test_multistep_keeps_its_step_and_resumes_from_it():
    p = solver_param(lr_policy='multistep', base_lr=1.0, gamma=0.5, stepvalue=[2, 4])
    policy = LearningRatePolicy(p)
    steps = []
    for it in range(6):
        policy.rate(it)
        steps.append(policy.current_step)
    assert steps == [0, 0, 1, 1, 2, 2]
    resumed = LearningRatePolicy(p)
    resumed.current_step = 1          # what a solverstate restores
    assert float(resumed.rate(3)) == 0.5


@pytest.mark.parametrize('fields, message', [
    (dict(lr_policy='linear'), 'unknown lr_policy'),
    (dict(lr_policy=''), 'unknown lr_policy'),
    (dict(lr_policy='step', gamma=0.1), 'stepsize > 0'),
    (dict(lr_policy='sigmoid', gamma=-1.0, stepsize=2), 'gamma >= 0'),
    (dict(lr_policy='poly', power=1.0), 'max_iter > 0'),
])
def test_lr_policy_errors(fields, message):
    with pytest.raises(CaffeError, match=message):
        LearningRatePolicy(solver_param(**fields))


# ---- update rules ---------------------------------------------------------------------------
def reference_updates(kind, p, grads, lr_mult, rate):
    """Float64 updates of one param for a sequence of gradients, as the golden README states."""
    lr = rate * lr_mult
    m, delta = p.momentum, p.delta
    h1 = np.zeros_like(grads[0])
    h2 = np.zeros_like(grads[0])
    out = []
    for it, g in enumerate(grads):
        if kind == 'SGD':
            h1 = m * h1 + lr * g
            upd = h1
        elif kind == 'Nesterov':
            old, h1 = h1, m * h1 + lr * g
            upd = (1 + m) * h1 - m * old
        elif kind == 'AdaGrad':
            h1 = h1 + g * g
            upd = lr * g / (np.sqrt(h1) + delta)
        elif kind == 'RMSProp':
            h1 = p.rms_decay * h1 + (1 - p.rms_decay) * g * g
            upd = lr * g / (np.sqrt(h1) + delta)
        elif kind == 'AdaDelta':
            h1 = m * h1 + (1 - m) * g * g
            dx = g * np.sqrt((h2 + delta) / (h1 + delta))
            h2 = m * h2 + (1 - m) * dx * dx
            upd = lr * dx
        else:
            h1 = m * h1 + (1 - m) * g
            h2 = p.momentum2 * h2 + (1 - p.momentum2) * g * g
            t = it + 1
            upd = lr * math.sqrt(1 - p.momentum2 ** t) / (1 - m ** t) * h1 / (np.sqrt(h2) + delta)
        out.append(upd)
    return out, (h1, h2)


RULE_PARAMS = {
    'SGD': dict(momentum=0.9), 'Nesterov': dict(momentum=0.9), 'AdaGrad': dict(delta=1e-8),
    'RMSProp': dict(rms_decay=0.95, delta=1e-6), 'AdaDelta': dict(momentum=0.95, delta=1e-6),
    'Adam': dict(momentum=0.9, momentum2=0.999, delta=1e-8),
}


@pytest.mark.parametrize('kind', list(RULES))
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_update_rule_matches_formula(kind, dtype):
    rs = np.random.RandomState(3)
    p = solver_param(type=kind, **RULE_PARAMS[kind])
    shapes = [(3, 4), (5,)]
    blobs = [Blob(s, dtype) for s in shapes]
    lr_mults = [1.0, 2.0]
    rule = RULES[kind](p, blobs, lr_mults, dtype)
    assert len(rule.history) == len(blobs) * (2 if kind in ('Adam', 'AdaDelta') else 1)
    grads = [[rs.randn(*s) for _ in range(6)] for s in shapes]
    rate = 0.05
    for i, blob in enumerate(blobs):
        expected, moments = reference_updates(kind, p, grads[i], lr_mults[i], rate)
        for it, g in enumerate(grads[i]):
            blob.diff[...] = g
            rule.compute_update(i, blob, np.asarray(rate, dtype)[()], iteration=it)
            assert blob.diff.dtype == dtype
            tol = 2e-5 if dtype == np.float32 else 1e-11
            np.testing.assert_allclose(blob.diff, expected[it], rtol=tol, atol=tol * 1e-2,
                                       err_msg='%s param %d iter %d' % (kind, i, it))
        np.testing.assert_allclose(rule.history[i], moments[0], rtol=2e-5 if dtype == np.float32 else 1e-11)


@pytest.mark.parametrize('kind', ['AdaGrad', 'RMSProp'])
def test_rules_without_momentum_reject_it(kind):
    with pytest.raises(CaffeError, match='momentum cannot be used with %s' % kind):
        RULES[kind](solver_param(momentum=0.9), [Blob((2,))], [1.0])


# ---- the driver on a quadratic net ----------------------------------------------------------
class QuadraticNet:
    """loss = sum_i 0.5 * |a_i * (w_i - t)|^2 with a target t that changes every forward."""

    def __init__(self, shapes, lr_mults, decay_mults, dtype=np.float64, seed=0):
        rs = np.random.RandomState(seed)
        self.name = 'quadratic'
        self.context = LayerContext(dtype=dtype)
        self.learnable_params = [Blob(s, dtype) for s in shapes]
        for blob in self.learnable_params:
            blob.data[...] = rs.randn(*blob.shape)
        self.params_lr, self.params_weight_decay = list(lr_mults), list(decay_mults)
        self.scales = [rs.uniform(0.5, 2.0, s) for s in shapes]
        self.targets = rs.randn(50, sum(int(np.prod(s)) for s in shapes))
        self.calls = 0
        self.blobs = {'loss': Blob((), dtype)}
        self.layers = []                     # none: no batch norm skips an update here
        self.outputs = ['loss']
        self.output_blob_loss_weights = {'loss': 1.0}

    def _split(self, flat):
        out, start = [], 0
        for blob in self.learnable_params:
            out.append(flat[start:start + blob.count].reshape(blob.shape))
            start += blob.count
        return out

    def gradients(self, weights, call):
        return [a * a * (w - t) for a, w, t in zip(self.scales, weights, self._split(self.targets[call]))]

    def forward_prefilled(self):
        targets = self._split(self.targets[self.calls % 50])
        self.calls += 1
        loss = sum(0.5 * float(((a * (b.data - t)) ** 2).sum())
                   for a, b, t in zip(self.scales, self.learnable_params, targets))
        self.blobs['loss'].data[...] = loss
        return loss

    def forward_backward(self):
        call = self.calls % 50
        loss = self.forward_prefilled()
        for blob, g in zip(self.learnable_params, self.gradients([b.data for b in self.learnable_params], call)):
            blob.diff += g
        return loss

    def clear_param_diffs(self):
        for blob in self.learnable_params:
            blob.diff[...] = 0

    def share_weights_with(self, other):
        self.learnable_params = other.learnable_params

    @property
    def params(self):
        return {'quadratic': self.learnable_params}

    def save(self, path):
        with open(path, 'wb') as f:
            pickle.dump([b.data for b in self.learnable_params], f)

    save_hdf5 = save

    def copy_from(self, path, complete=False):
        with open(path, 'rb') as f:
            for blob, data in zip(self.learnable_params, pickle.load(f)):
                blob.data[...] = data


def quadratic_reference(net, p, iters):
    """Float64 SGD with momentum, iter_size, clipping and L1/L2 decay as the README orders it."""
    weights = [b.data.copy() for b in net.learnable_params]
    history = [np.zeros_like(w) for w in weights]
    call = 0
    for it in range(iters):
        grads = [np.zeros_like(w) for w in weights]
        for _ in range(p.iter_size):
            grads = [g + d for g, d in zip(grads, net.gradients(weights, call))]
            call += 1
        norm = math.sqrt(sum((g * g).sum() for g in grads))
        if p.clip_gradients >= 0 and norm > p.clip_gradients:
            grads = [g * p.clip_gradients / norm for g in grads]
        rate = reference_rate(p, it)
        for i, w in enumerate(weights):
            g = grads[i] / p.iter_size
            decay = p.weight_decay * net.params_weight_decay[i]
            g = g + decay * (w if p.regularization_type == 'L2' else np.sign(w))
            history[i] = p.momentum * history[i] + rate * net.params_lr[i] * g
            weights[i] = w - history[i]
    return weights, history


@pytest.mark.parametrize('fields', [
    dict(),
    dict(iter_size=3),
    dict(clip_gradients=0.5),
    dict(regularization_type='L1', weight_decay=0.01),
    dict(lr_policy='multistep', stepvalue=[2, 5], gamma=0.5),
], ids=['plain', 'iter_size', 'clip', 'l1', 'multistep'])
def test_driver_matches_reference(fields):
    base = dict(type='SGD', base_lr=0.05, lr_policy='fixed', momentum=0.9, weight_decay=0.005)
    base.update(fields)
    p = solver_param(**base)
    net = QuadraticNet([(3, 2), (4,), (2,)], lr_mults=[1.0, 2.0, 0.0], decay_mults=[1.0, 0.0, 1.0])
    expected_w, expected_h = quadratic_reference(net, p, 7)
    solver = Solver(p, net=net)
    solver.step(7)
    assert solver.iter == 7
    for blob, w in zip(net.learnable_params, expected_w):
        np.testing.assert_allclose(blob.data, w, rtol=1e-12, atol=1e-12)
    for h, e in zip(solver.rule.history, expected_h):
        np.testing.assert_allclose(h, e, rtol=1e-12, atol=1e-12)


def test_display_lines_and_smoothed_loss(caplog):
    p = solver_param(type='SGD', base_lr=0.01, lr_policy='fixed', display=2, average_loss=3,
                     test_iter=[2], test_interval=4, test_compute_loss=True)
    net = QuadraticNet([(2, 2)], [1.0], [1.0])
    test_net = QuadraticNet([(2, 2)], [1.0], [1.0], seed=1)
    solver = Solver(p, net=net, test_nets=[test_net])
    losses = []
    original = solver.forward_backward_all
    solver.forward_backward_all = lambda: losses.append(original()) or losses[-1]
    with caplog.at_level(logging.INFO, logger='caffe_syncbn'):
        solver.step(5)
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count('Iteration 0, Testing net (#0)') == 1
    assert 'Iteration 4, Testing net (#0)' in lines
    assert any(line.startswith('Test loss: ') for line in lines)
    assert any(line.startswith('    Test net output #0: loss = ') and line.endswith(' loss)') for line in lines)
    assert "Iteration 4, loss = %g" % np.mean(losses[2:5]) in lines   # the last average_loss losses
    assert 'Iteration 0, loss = %g' % losses[0] in lines
    assert 'Iteration 2, lr = 0.01' in lines
    assert '    Train net output #0: loss = %g (* 1 = %g loss)' % (
        net.blobs['loss'].data, net.blobs['loss'].data) in lines
    assert not any(line.startswith('Iteration 1,') for line in lines)


def test_test_all_returns_mean_outputs():
    p = solver_param(type='SGD', base_lr=0.0, lr_policy='fixed', test_iter=[3], test_interval=100)
    net = QuadraticNet([(2,)], [1.0], [1.0])
    test_net = QuadraticNet([(2,)], [1.0], [1.0])
    solver = Solver(p, net=net, test_nets=[test_net])
    seen = []
    original = test_net.forward_prefilled
    test_net.forward_prefilled = lambda: seen.append(original()) or seen[-1]
    (result,) = solver.test_all()
    assert result['loss'] == pytest.approx(np.mean(seen))


def test_actions_stop_and_snapshot(tmp_path):
    p = solver_param(type='SGD', base_lr=0.01, lr_policy='fixed', max_iter=10,
                     snapshot_prefix=str(tmp_path / 'q'))
    solver = Solver(p, net=QuadraticNet([(2,)], [1.0], [1.0]))
    actions = iter([None, 'snapshot', None, 'stop'])
    solver.action_request = lambda: next(actions, None)
    solver.solve()
    assert solver.iter == 4
    assert (tmp_path / 'q_iter_2.solverstate').exists()
    assert (tmp_path / 'q_iter_4.solverstate').exists()   # snapshot_after_train on early exit
    assert not (tmp_path / 'q_iter_10.solverstate').exists()


def test_snapshot_schedule_and_restore(tmp_path):
    p = solver_param(type='Adam', base_lr=0.01, lr_policy='fixed', momentum=0.9, max_iter=6, snapshot=4,
                     snapshot_prefix=str(tmp_path / 'a'), snapshot_format=caffe_pb2.SolverParameter.HDF5)
    net = QuadraticNet([(3,), (2, 2)], [1.0, 1.0], [1.0, 1.0])
    solver = Solver(p, net=net)
    solver.solve()
    solver.close()                          # which removes the prefix's lock file
    names = sorted(f.name for f in tmp_path.iterdir())
    assert names == ['a_iter_4.caffemodel.h5', 'a_iter_4.solverstate.h5',
                     'a_iter_6.caffemodel.h5', 'a_iter_6.solverstate.h5']
    state = read_solver_state(tmp_path / 'a_iter_6.solverstate.h5')
    assert state.iter == 6 and len(state.history) == 4
    assert state.learned_net == str(tmp_path / 'a_iter_6.caffemodel.h5')
    fresh = QuadraticNet([(3,), (2, 2)], [1.0, 1.0], [1.0, 1.0])
    for blob in fresh.learnable_params:
        blob.data[...] = 7.0                # restore must bring back the snapshot's weights
    resumed = Solver(p, net=fresh)
    resumed.restore(tmp_path / 'a_iter_4.solverstate.h5')
    resumed.net.calls = net.calls - 2
    resumed.step(2)
    for a, b in zip(resumed.net.learnable_params, net.learnable_params):
        np.testing.assert_array_equal(a.data, b.data)


def test_restore_rejects_wrong_history(tmp_path):
    write_solver_state(tmp_path / 's.solverstate', SolverState(3, '', 0, [np.zeros(2, np.float32)]))
    solver = Solver(solver_param(type='Adam', base_lr=0.1, lr_policy='fixed'),
                    net=QuadraticNet([(2,)], [1.0], [1.0]))
    with pytest.raises(CaffeError, match='has 1 history blobs, but a Adam solver .* needs 2'):
        solver.restore(tmp_path / 's.solverstate')


def test_solver_param_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'bad.prototxt').write_text('base_lr: 0.1\nlr_policy: "fixed"\nmomentum 0.9 0.1\n')
    with pytest.raises(CaffeError, match=r'bad.prototxt:3:'):
        load_solver_param('bad.prototxt')
    sub = tmp_path / 'sub'
    sub.mkdir()
    (sub / 'net.prototxt').write_text('name: "n"\n')
    (sub / 'solver.prototxt').write_text('net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\n'
                                         'solver_type: ADAM\n')
    param = load_solver_param('sub/solver.prototxt')
    assert param.type == 'Adam' and param.snapshot_prefix == 'sub/solver'
    with pytest.raises(CaffeError, match="net file 'net.prototxt' not found .*exists next to the solver"):
        get_solver('sub/solver.prototxt')
    with pytest.raises(CaffeError, match='unknown solver type'):
        get_solver_class('Adamax')
    with pytest.raises(CaffeError, match='exactly one of net'):
        Solver(solver_param(base_lr=0.1, lr_policy='fixed'))
    with pytest.raises(CaffeError, match='regularization_type'):
        Solver(solver_param(lr_policy='fixed', regularization_type='L3'), net=QuadraticNet([(1,)], [1], [1]))


# ---- a real Net ----------------------------------------------------------------------------------
TINY_NET = """name: "tiny"
layer { name: "input" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
layer { name: "scale" type: "Scale" bottom: "data" top: "s"
  scale_param { bias_term: true filler { type: "uniform" min: 0.5 max: 1.5 } } }
layer { name: "bn" type: "BatchNorm" bottom: "s" top: "s" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "s" bottom: "label" top: "accuracy"
  include { phase: TEST } }
"""


def tiny_solver(folder, **fields):
    (folder / 'net.prototxt').write_text(TINY_NET)
    settings = dict(net='"net.prototxt"', base_lr=0.1, lr_policy='"multistep"', stepvalue=[2, 4], gamma=0.5,
                    momentum=0.9, weight_decay=0.001, max_iter=6, test_iter=2, test_interval=2,
                    snapshot=3, snapshot_prefix='"snap/tiny"', random_seed=1)
    settings.update(fields)
    lines = ['%s: %s' % (key, v) for key, value in settings.items()
             for v in (value if isinstance(value, list) else [value])]
    (folder / 'solver.prototxt').write_text('\n'.join(lines) + '\n')
    (folder / 'snap').mkdir(exist_ok=True)
    return get_solver('solver.prototxt')


def batches(seed, start=0):
    rs = np.random.RandomState(seed)
    items = [{'data': rs.randn(4, 3), 'label': rs.randint(0, 3, 4)} for _ in range(20)]
    position = iter(items[start:])
    return lambda: next(position)


@pytest.mark.parametrize('fmt', ['BINARYPROTO', 'HDF5'])
def test_real_net_resume_matches_uninterrupted_run(fmt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    solver = tiny_solver(tmp_path, snapshot_format=fmt)
    assert solver.test_nets[0].params['scale'][0] is solver.net.params['scale'][0]
    solver.set_data_source(batches(0))
    solver.set_data_source(batches(1), test_net=0)
    solver.solve()
    suffix = '.h5' if fmt == 'HDF5' else ''
    assert (tmp_path / ('snap/tiny_iter_3.caffemodel' + suffix)).exists()
    state_file = 'snap/tiny_iter_3.solverstate' + suffix
    assert read_solver_state(state_file).current_step == 1
    resumed = tiny_solver(tmp_path, snapshot_format=fmt, snapshot=0, snapshot_after_train='false')
    resumed.set_data_source(batches(0, start=3))
    resumed.set_data_source(batches(1), test_net=0)
    resumed.solve(resume_file=state_file)
    assert resumed.iter == 6 and resumed.current_step == 2
    for layer, blobs in solver.net.params.items():
        for a, b in zip(blobs, resumed.net.params[layer]):
            np.testing.assert_array_equal(a.data, b.data, err_msg=layer)


def test_real_net_float64_and_accuracy_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'net.prototxt').write_text(TINY_NET)
    param = load_solver_param(tiny_solver(tmp_path).source)
    solver = get_solver_class(param.type)(param, dtype=np.float64)
    assert solver.net.params['scale'][0].dtype == np.float64
    solver.set_data_source(batches(0))
    solver.set_data_source(batches(1), test_net=0)
    solver.step(2)
    (result,) = solver.test_all()
    assert set(result) == {'loss', 'accuracy'} and 0 <= result['accuracy'] <= 1


def test_weights_field_finetunes_train_and_test_nets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = tiny_solver(tmp_path)
    source.net.params['scale'][0].data[...] = [1.0, 2.0, 3.0]
    source.net.save('init.caffemodel')
    solver = tiny_solver(tmp_path, weights='" init.caffemodel,init.caffemodel"')
    np.testing.assert_array_equal(solver.net.params['scale'][0].data, [1.0, 2.0, 3.0])
    assert solver.test_nets[0].params['scale'][0] is solver.net.params['scale'][0]


# ---- solverstate files ------------------------------------------------------------------------
def test_solverstate_binary_is_byte_identical_to_caffes(tmp_path):
    path = require(GOLDEN / 'solver_snapshot_binaryproto_iter_6.solverstate')
    state = read_solver_state(path)
    assert (state.iter, state.current_step) == (6, 1)
    assert state.learned_net == 'solver_snapshot_binaryproto_iter_6.caffemodel'
    write_solver_state(tmp_path / 'x.solverstate', state)
    assert (tmp_path / 'x.solverstate').read_bytes() == path.read_bytes()


def test_solverstate_hdf5_has_caffes_layout(tmp_path):
    h5py = pytest.importorskip('h5py')
    path = require(GOLDEN / 'solver_snapshot_hdf5_iter_6.solverstate.h5')
    state = read_solver_state(path)
    assert state.iter == 6 and len(state.history) == 18
    ours = tmp_path / 'x.solverstate.h5'
    write_solver_state(ours, state)

    def layout(file_path):
        out = {}
        with h5py.File(file_path, 'r') as f:
            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    t = obj.id.get_type()
                    pad = t.get_strpad() if isinstance(t, h5py.h5t.TypeStringID) else None
                    out[name] = (obj.dtype.str, obj.shape, pad, obj[()].tobytes())
                else:
                    out[name] = 'group'
            f.visititems(visit)
        return out
    assert layout(ours) == layout(path)
    again = read_solver_state(ours)
    assert again.learned_net == state.learned_net
    for a, b in zip(again.history, state.history):
        np.testing.assert_array_equal(a, b)


# ---- golden trajectories ------------------------------------------------------------------------
def solver_cases():
    index = GOLDEN / 'index.json'
    if not index.exists():
        return ['<no golden data>']
    return [c['name'] for c in json.loads(index.read_text())['cases'] if c['kind'] == 'solver']


class GoldenFeed:
    """Feeds iter_data/<k>[/<j>]/{data,label} to the Input blobs, one batch per forward."""

    def __init__(self, ref, first_iter):
        self.ref, self.iter_size = ref, int(ref['iter_size'])
        self.k, self.j = first_iter, 0

    def __call__(self):
        prefix = 'iter_data/%d/' % self.k + ('%d/' % self.j if self.iter_size > 1 else '')
        self.j += 1
        if self.j == self.iter_size:
            self.k, self.j = self.k + 1, 0
        return {'data': self.ref[prefix + 'data'], 'label': self.ref[prefix + 'label']}


RTOL = 1e-5
# Solvers whose step is g / sqrt(running mean of g^2): a gradient of pure rounding noise
# still moves the param by about lr per iteration.
NORMALIZED_STEP_TYPES = ('AdaGrad', 'RMSProp', 'Adam')


def assert_close(actual, expected, what):
    """Within RTOL of the blob's scale (elements near zero are judged against the whole blob)."""
    expected = np.asarray(expected, np.float64)
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=RTOL,
                               atol=RTOL * float(np.abs(expected).max(initial=0)), err_msg=what)


class CancelledBias:
    """A Convolution bias that feeds a TRAIN BatchNorm directly.

    BatchNorm subtracts the batch mean, so the bias has no effect on the loss: its true
    gradient is 0, and in float32 both Caffe and this package compute ~1e-8 of rounding
    noise instead, which no reimplementation reproduces bit for bit. SGD-like solvers
    scale that noise by lr (harmless); AdaGrad/RMSProp/Adam normalize it to a step of
    about lr. So for those solvers the bias and BatchNorm's running-mean sum (which adds
    up the bias of every forward) follow different noise. What must still match, and is
    checked, is the running mean net of the biases: M_k - maf^k M_0 - sum_t maf^(k-t) b_(t-1).
    """

    def __init__(self, conv, bn, maf):
        self.conv, self.bn, self.maf = conv, bn, maf
        self.state = {}

    def start(self, who, mean, bias):
        self.state[who] = (np.asarray(mean, np.float64), np.asarray(bias, np.float64), 0.0)

    def advance(self, who, mean, bias):
        base, previous_bias, biases = self.state[who]
        base, biases = self.maf * base, self.maf * biases + previous_bias
        self.state[who] = (base, np.asarray(bias, np.float64), biases)
        return np.asarray(mean, np.float64) - base - biases

    @staticmethod
    def find(net):
        found, producer = [], {}
        for lp in net.net_param.layer:
            bn = lp.batch_norm_param
            if lp.type == 'BatchNorm' and not (bn.HasField('use_global_stats') and bn.use_global_stats):
                source = producer.get(lp.bottom[0])
                if source is not None and source.type == 'Convolution' and len(net.params[source.name]) > 1:
                    found.append(CancelledBias(source.name, lp.name, bn.moving_average_fraction))
            for top in lp.top:
                producer[top] = lp
        return found


def check_iteration(solver, ref, k, cancelled, prefix=''):
    np.testing.assert_allclose(solver.smoothed_loss, ref['%siter_loss/%d' % (prefix, k)], rtol=RTOL,
                               err_msg='loss of iteration %d' % k)
    np.testing.assert_allclose(solver.last_rate, ref['%siter_lr/%d' % (prefix, k)], rtol=RTOL,
                               err_msg='lr of iteration %d' % k)
    head = '%siter_param/%d/' % (prefix, k)
    params = solver.net.params
    skipped = {(c.conv, '1') for c in cancelled} | {(c.bn, '0') for c in cancelled}
    keys = [key for key in ref.files if key.startswith(head)]
    assert keys
    for key in keys:
        layer, index = key[len(head):].rsplit('/', 1)
        if (layer, index) not in skipped:
            assert_close(params[layer][int(index)].data, ref[key], '%s (iteration %d)' % (key, k))
    for c in cancelled:
        ours = c.advance('ours', params[c.bn][0].data, params[c.conv][1].data)
        theirs = c.advance('caffe', ref[head + c.bn + '/0'], ref[head + c.conv + '/1'])
        assert_close(ours, theirs, 'running mean of %s net of the %s bias (iteration %d)' % (c.bn, c.conv, k))


def golden_solver(name, tmp_path, memory_plan='off'):
    param = load_solver_param(name + '.solver.prototxt')
    param.snapshot_prefix = str(tmp_path / name)    # never write into the shared folder
    return get_solver_class(param.type)(param, memory_plan=memory_plan)


def cancelled_biases(solver, ours, caffe):
    """CancelledBias trackers (normalized-step solvers only), started at ``ours``/``caffe`` params."""
    if solver.param.type not in NORMALIZED_STEP_TYPES:
        return []
    found = CancelledBias.find(solver.net)
    for c in found:
        c.start('ours', ours(c.bn, 0), ours(c.conv, 1))
        c.start('caffe', caffe(c.bn, 0), caffe(c.conv, 1))
    return found


@pytest.mark.parametrize('memory_plan', MEMORY_PLANS)
@pytest.mark.parametrize('name', solver_cases())
def test_golden_solver(name, memory_plan, tmp_path, monkeypatch):
    """12 iterations of real Caffe's solver, under every memory plan."""
    require(GOLDEN / (name + '.npz'))
    monkeypatch.chdir(GOLDEN)
    ref = np.load(GOLDEN / (name + '.npz'))
    solver = golden_solver(name, tmp_path, memory_plan)
    assert solver.net.memory_plan in (memory_plan, 'inplace_abn', 'recompute')
    solver.net.copy_from(name + '.caffemodel')
    for key in ref.files:
        if key.startswith('init_param/'):
            layer, index = key[len('init_param/'):].rsplit('/', 1)
            np.testing.assert_array_equal(solver.net.params[layer][int(index)].data, ref[key])
    initial = lambda layer, i: ref['init_param/%s/%d' % (layer, i)]          # noqa: E731
    cancelled = cancelled_biases(solver, initial, initial)
    solver.set_data_source(GoldenFeed(ref, 1))
    snapshot_at = int(ref['snapshot_iter']) if 'snapshot_iter' in ref.files else None
    ours = None
    for k in range(1, 13):
        solver.step(1)
        assert solver.iter == k
        check_iteration(solver, ref, k, cancelled)
        if k == snapshot_at:
            ours = solver.snapshot()
    if snapshot_at is None:
        return
    hdf5 = ours[1].endswith('.h5')
    theirs = name + '_iter_6.solverstate' + ('.h5' if hdf5 else '')
    mine, caffe_state = read_solver_state(ours[1]), read_solver_state(theirs)
    assert (mine.iter, mine.current_step) == (caffe_state.iter, caffe_state.current_step)
    assert mine.learned_net == ours[0] and len(mine.history) == len(caffe_state.history)
    # a cancelled bias's history holds its noise gradient (whatever the solver type), and
    # with the noise-following running mean (``cancelled``) so does that mean's (weight decay)
    noisy = {id(solver.net.params[c.conv][1]) for c in CancelledBias.find(solver.net)}
    noisy |= {id(solver.net.params[c.bn][0]) for c in cancelled}
    count = len(solver.net.learnable_params)
    for i, (a, b) in enumerate(zip(mine.history, caffe_state.history)):
        if id(solver.net.learnable_params[i % count]) not in noisy:
            assert_close(a, b, 'history blob %d of the snapshot' % i)
    at_snapshot = lambda layer, i: ref['iter_param/%d/%s/%d' % (snapshot_at, layer, i)]  # noqa: E731
    for state_file in (theirs, ours[1]):
        resumed = golden_solver(name, tmp_path)
        resumed.restore(state_file)
        assert resumed.iter == snapshot_at
        for restored_history, saved in zip(resumed.rule.history, read_solver_state(state_file).history):
            np.testing.assert_array_equal(restored_history, saved)
        restored = lambda layer, i: resumed.net.params[layer][i].data                 # noqa: E731
        cancelled = cancelled_biases(resumed, restored, at_snapshot)
        resumed.set_data_source(GoldenFeed(ref, snapshot_at + 1))
        for k in range(snapshot_at + 1, 13):
            resumed.step(1)
            check_iteration(resumed, ref, k, cancelled, prefix='resume/')


# ---- the snapshot prefix, checked at the start ----------------------------------------------
def test_the_prefix_probe_opens_no_predictable_name(tmp_path):
    """A link planted at the name the old probe used (``<prefix>_iter_0.tempfile``) is left
    alone, and so is the file it points to."""
    target = tmp_path / 'precious.txt'
    target.write_text('keep me')
    planted = tmp_path / 'snap_iter_0.tempfile'
    planted.symlink_to(target)
    _probe_solver(tmp_path, snapshot=2, snapshot_prefix=str(tmp_path / 'snap')).close()
    assert target.read_text() == 'keep me' and planted.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ['net.prototxt', 'precious.txt',
                                                         'snap_iter_0.tempfile']


@pytest.mark.parametrize('snapshot', [0, 2])
def test_a_prefix_that_cannot_be_written_fails_at_the_start(tmp_path, snapshot):
    """Also when the final snapshot (snapshot_after_train) is the only one."""
    with pytest.raises(CaffeError, match="cannot write to snapshot prefix '.*missing/snap'"):
        _probe_solver(tmp_path, snapshot=snapshot, snapshot_prefix=str(tmp_path / 'missing' / 'snap'))
    _probe_solver(tmp_path, snapshot=0, snapshot_after_train=False,
                  snapshot_prefix=str(tmp_path / 'missing' / 'snap'))   # no snapshot: no check


def _probe_solver(tmp_path, **fields):
    (tmp_path / 'net.prototxt').write_text(
        'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
        'inner_product_param { num_output: 2 } }\n')
    return Solver(solver_param(net=str(tmp_path / 'net.prototxt'), base_lr=0.1, lr_policy='fixed',
                               **fields))
