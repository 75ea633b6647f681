"""memory_plan='share' in a net that runs backward: blobs and diffs share storage by liveness
(a blob's data until the last backward that reads it), their arena filled with NaN bytes
first, and every gradient stays bitwise what the net with every blob kept gives: on every
golden net, ResNet-50, and 10 solver iterations under SyncBN on 2 devices."""
import re

import numpy as np
import pytest
from google.protobuf import text_format

import caffe_syncbn as caffe
from caffe_syncbn import memory_plan
from caffe_syncbn.backend import to_numpy
from caffe_syncbn.analysis.timing import timing_net_param
from caffe_syncbn.layer import LayerContext
from caffe_syncbn.training.solvers import get_solver
from helpers.paths import GOLDEN, ROOT, require
from helpers.cuda_emulation import emulated_kernels
from helpers.net_helpers import build
from test_memory_plan import _text_param
from test_data_parallel import batches, solver_param
from test_memory_plan import golden_nets, inputs_of, most_bytes_live, random_param, weights_of


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    monkeypatch.setattr(memory_plan, 'new_buffer',
                        lambda xp, nbytes: xp.full(nbytes, 0xFF, np.uint8))


def twin_nets(model, weights=None, keep=(), plan='share'):
    """The same TRAIN net with every blob kept and under ``plan``, the same weights and the
    same random draws (Dropout)."""
    nets = [caffe.Net(model, caffe.TRAIN, weights=weights, memory_plan=plan, keep=keep,
                      context=LayerContext(rng=np.random.RandomState(3)))
            for plan in ('off', plan)]
    rs = np.random.RandomState(0)
    for mine, theirs in zip(*(net.layers for net in nets)):
        for a, b in zip(mine.blobs, theirs.blobs):
            if weights is None:
                a.data[...] = random_param(rs, a.shape)
            b.data[...] = a.data
    return nets


def same_gradients(nets, inputs, seed=2, tol=0):
    """Forward, output diffs of one random draw, backward: equal losses, input and param
    diffs (within ``tol`` of the largest diff of their blob, or of the net's where a blob's
    true gradient is 0: a bias before a batch norm)."""
    losses = []
    for net in nets:
        for name, value in inputs.items():
            net.blobs[name].reshape(value.shape)
            net.blobs[name].data[...] = value
        losses.append(net.forward_prefilled())
        rs = np.random.RandomState(seed)
        for name in net.outputs:
            if name not in net.output_blob_loss_weights:
                net.blobs[name].diff[...] = rs.standard_normal(net.blobs[name].shape)
        net.backward_from()
    kept, shared = nets
    assert losses[0] == pytest.approx(losses[1], rel=tol) or np.isnan(losses).all()
    pairs = [(shared.blobs[name].diff, kept.blobs[name].diff, name) for name in kept.inputs]
    pairs += [(b.diff, a.diff, 'param %d' % j)
              for j, (a, b) in enumerate(zip(kept.learnable_params, shared.learnable_params))]
    largest = max([float(np.abs(want).max(initial=0)) for _, want, _ in pairs] + [1e-6])
    for got, want, what in pairs:
        if tol:
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(
                float(np.abs(want).max(initial=0)), 1e-3 * largest), err_msg=what)
        else:
            np.testing.assert_array_equal(got, want, what)


@pytest.mark.parametrize('name', golden_nets())
@pytest.mark.parametrize('plan', ['share', 'inplace_abn', 'recompute'])
def test_every_golden_net_gives_the_same_gradients(name, plan, monkeypatch):
    """share: bitwise; the chains of inplace_abn and recompute round differently."""
    require(GOLDEN / (name + '.prototxt'))
    monkeypatch.chdir(GOLDEN)
    try:
        nets = twin_nets(str(GOLDEN / (name + '.prototxt')), weights_of(name), plan=plan)
    except caffe.CaffeError as exc:
        pytest.skip('no TRAIN net to build: %s' % exc)
    recorded = np.load(GOLDEN / (name + '.npz'))
    inputs = {k.split('/', 1)[1]: recorded[k] for k in recorded.files if k.startswith('input/')}
    same_gradients(nets, inputs or inputs_of(nets[0]), tol=0 if plan == 'share' else 1e-4)


def test_resnet50_diffs_share_a_few_buffers():
    param = timing_net_param(ROOT / 'examples' / 'resnet50' / 'ResNet-50-deploy.prototxt', batch=1)
    nets = twin_nets(param)
    same_gradients(nets, inputs_of(nets[0]))
    kept, shared = nets
    every_blob = sum(blob.data.nbytes + blob.diff.nbytes for blob in kept.blobs.values())
    arena = shared.planner.plan.arena.nbytes
    assert most_bytes_live(shared.planner.plan.groups) <= arena < every_blob / 2.5
    # a new input shape plans again
    same_gradients(nets, {name: np.concatenate([x, x[::-1]])
                          for name, x in inputs_of(kept, 2).items()})
    assert shared.planner.plan.holds() and abs(shared.planner.plan.arena.nbytes - 2 * arena) < 2 * len(
        shared.planner.plan.groups) * memory_plan.ALIGNMENT


BRANCHES = '''name: "branches"
layer { name: "in" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "a"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "relu" type: "ReLU" bottom: "a" top: "a" }
layer { name: "left" type: "Convolution" bottom: "a" top: "left"
        convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "right" type: "Convolution" bottom: "a" top: "right" propagate_down: false
        convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "sum" type: "Eltwise" bottom: "left" bottom: "right" top: "sum" }
layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool"
        pooling_param { pool: AVE global_pooling: true } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "pool" bottom: "label" top: "loss" }
'''


def test_kept_and_unwritten_diffs_have_storage_of_their_own():
    """A blob named in ``keep`` keeps its true diff; a diff its consumer does not write
    (propagate_down: false) is no other blob's; the loss top keeps its loss weight."""
    nets = [build(BRANCHES, memory_plan=plan, keep=keep)
            for plan, keep in (('off', ()), ('share', ['left']))]
    rs = np.random.RandomState(0)
    inputs = {'x': rs.standard_normal((4, 3, 6, 6)), 'label': np.array([0, 3, 1, 2.0])}
    for mine, theirs in zip(*(net.layers for net in nets)):
        for a, b in zip(mine.blobs, theirs.blobs):
            a.data[...] = random_param(rs, a.shape)
            b.data[...] = a.data
    same_gradients(nets, inputs)
    kept, shared = nets
    by_name = {name: blob for names, blobs in zip(shared.top_names.values(),
                                                  shared.planner.wiring.tops)
               for name, blob in zip(names, blobs)}
    planned_diffs = {id(group.owner) for group in shared.planner.plan.groups if group.is_diff}
    for name in ('left', 'x', 'loss', 'a_relu_0_split_1'):
        assert id(by_name[name]) not in planned_diffs, name
    np.testing.assert_array_equal(shared.blobs['left'].diff, kept.blobs['left'].diff)
    assert float(shared.blobs['loss'].diff) == 1.0
    assert id(by_name['sum']) in planned_diffs


def train(plan, devices='cpu:2', steps=10):
    solver = get_solver(solver_param('SyncBN'), devices=devices, sync_bn=True, memory_plan=plan)
    feed = iter(batches(steps))
    solver.set_data_source(lambda: next(feed))
    solver.step(steps)
    params = [to_numpy(b.data).copy() for b in solver.net.learnable_params]
    stats = [to_numpy(b.data).copy() for layer in solver.net.layers for b in layer.blobs]
    solver.close()
    return params + stats


def test_ten_solver_iterations_under_syncbn_on_two_devices_are_bitwise_those_of_off():
    for a, b in zip(train('off'), train('share')):
        np.testing.assert_array_equal(b, a)


def test_get_solver_names_the_memory_plans():
    with pytest.raises(caffe.CaffeError, match=r"^memory_plan 'all': expected one of off, share"):
        get_solver(solver_param('SyncBN'), devices='cpu:1', memory_plan='all')


def test_the_solver_file_names_the_plan_and_the_caller_overrides_it(tmp_path):
    """SolverParameter's memory_plan (a field of ours): the plan of every net the solver
    builds, unless get_solver (or -memory_plan) names one; a bad one names the file."""
    param = solver_param('SyncBN')
    param.memory_plan = 'share'
    path = tmp_path / 'solver.prototxt'
    path.write_text(text_format.MessageToString(param))
    assert {net.memory_plan for net in get_solver(str(path), devices='cpu:2').replicas} == \
        {'share'}
    assert get_solver(str(path), devices=None).net.memory_plan == 'share'
    assert get_solver(str(path), devices=None, memory_plan='off').net.memory_plan == 'off'
    param.ClearField('memory_plan')
    assert get_solver(param, devices=None).net.memory_plan == 'off'      # pycaffe's default
    path.write_text(text_format.MessageToString(param) + 'memory_plan: "tiny"\n')
    with pytest.raises(caffe.CaffeError, match=r"^%s: memory_plan 'tiny': expected one of "
                                                r"off, share" % re.escape(str(path))):
        get_solver(str(path), devices='cpu:1')


PYRAMID = '''name: "pyramid"
layer { name: "in" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 16 dim: 16 } shape { dim: 2 dim: 1 dim: 64 dim: 64 } } }
layer { name: "conv1" type: "Convolution" bottom: "x" top: "c1"
        convolution_param { num_output: 32 kernel_size: 3 pad: 1 } }
layer { name: "bn1" type: "BatchNorm" bottom: "c1" top: "c1" batch_norm_param { use_global_stats: true } }
layer { name: "scale1" type: "Scale" bottom: "c1" top: "c1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "pool" type: "Pooling" bottom: "c1" top: "p" pooling_param { pool: AVE kernel_size: 4 stride: 4 } }
layer { name: "pconv" type: "Convolution" bottom: "p" top: "pc" convolution_param { num_output: 32 kernel_size: 1 } }
layer { name: "up" type: "Interp" bottom: "pc" top: "u" interp_param { height: 16 width: 16 } }
layer { name: "cat" type: "Concat" bottom: "c1" bottom: "u" top: "cat" }
layer { name: "conv2" type: "Convolution" bottom: "cat" top: "c2" convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "up2" type: "Interp" bottom: "c2" top: "scores" interp_param { height: 64 width: 64 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "scores" bottom: "label" top: "loss" }
'''


def test_recompute_runs_a_concat_again_and_its_gradients_stay_bitwise():
    """A PSPNet head: 'recompute' lets the Concat's top go after the forward, for the
    scores at full size, and runs the Concat again before conv2's backward (its bottoms
    live on: c1 for its batch norm's backward, u at less cost than cat); the arena shrinks,
    and every gradient is bitwise that of 'inplace_abn', which keeps the top."""
    rs = np.random.RandomState(5)
    inputs = {'x': rs.standard_normal((2, 3, 16, 16)),
              'label': rs.randint(0, 8, (2, 1, 64, 64)).astype(float)}
    runs = {}
    for plan in ('inplace_abn', 'recompute'):
        nets = twin_nets(_text_param(PYRAMID), plan=plan)
        for layer in (layer for net in nets for layer in net.layers if layer.type == 'BatchNorm'):
            layer.blobs[2].data[...] = 1          # the statistics' scale: a true variance
        same_gradients(nets, inputs, tol=1e-4)
        runs[plan] = nets[1]
    lean, full = runs['inplace_abn'], runs['recompute']
    names = {full._layer_names[g.rerun] for g in full.planner.plan.groups if g.rerun is not None}
    assert 'cat' in names and full.planner.plan.arena.nbytes < lean.planner.plan.arena.nbytes
    for a, b in zip(lean.learnable_params, full.learnable_params):
        np.testing.assert_array_equal(a.diff, b.diff)
    np.testing.assert_array_equal(lean.blobs['x'].diff, full.blobs['x'].diff)


def test_auto_takes_recompute_only_where_it_saves_a_tenth():
    arenas = {}
    for name, param in (('pyramid', _text_param(PYRAMID)), ('branches', _text_param(BRANCHES))):
        for plan in ('auto', 'inplace_abn', 'recompute'):
            net = caffe.Net(param, caffe.TRAIN, memory_plan=plan)
            arenas[name, plan] = net.planner.plan.arena.nbytes, net.memory_plan
    assert arenas['pyramid', 'auto'] == (arenas['pyramid', 'recompute'][0], 'recompute')
    assert arenas['pyramid', 'recompute'][0] <= 0.9 * arenas['pyramid', 'inplace_abn'][0]
    assert arenas['branches', 'auto'] == (arenas['branches', 'inplace_abn'][0], 'inplace_abn')
    assert caffe.Net(_text_param(PYRAMID), caffe.TEST, memory_plan='auto').memory_plan == \
        'inplace_abn'                     # forward only: nothing to recompute


def test_recompute_runs_the_concat_again_on_the_cuda_kernels(monkeypatch):
    """The same head on the kernels of cuda/ (emulated): the batch norm's fused chain, AVE
    pooling and Interp on the kernels, the Concat written again, against 'off' on the host."""
    emulated_kernels(monkeypatch)
    param = _text_param(PYRAMID)
    nets = [caffe.Net(param, caffe.TRAIN, memory_plan=plan,
                      context=LayerContext(rng=np.random.RandomState(3), cuda_kernels=kernels))
            for plan, kernels in (('off', False), ('recompute', True))]
    rs = np.random.RandomState(0)
    for mine, theirs in zip(*(net.layers for net in nets)):
        for a, b in zip(mine.blobs, theirs.blobs):
            a.data[...] = b.data[...] = random_param(rs, a.shape)
    rs = np.random.RandomState(7)
    same_gradients(nets, {'x': rs.standard_normal((2, 3, 16, 16)),
                          'label': rs.randint(0, 8, (2, 1, 64, 64)).astype(float)}, tol=1e-4)
    assert any(nets[1]._layer_names[g.rerun] == 'cat' for g in nets[1].planner.plan.groups
               if g.rerun is not None)


def test_a_partial_pass_that_needs_what_the_plan_shares_says_which_blob_to_keep():
    """pycaffe's forward(start=...) and backward(start=...) under a plan: a pass that would
    read a blob or diff an earlier part of the net wrote into shared storage, cut a chain
    that one layer runs, or miss recompute's refills, stops with one line; kept blobs make
    the same pass run as with every blob kept."""
    rs = np.random.RandomState(5)
    inputs = {'x': rs.standard_normal((2, 3, 16, 16)),
              'label': rs.randint(0, 8, (2, 1, 64, 64)).astype(float)}
    off, planned = twin_nets(_text_param(PYRAMID), plan='inplace_abn', keep=['cat', 'c2'])
    for net in (off, planned):
        net.forward(**inputs)
    with pytest.raises(caffe.CaffeError, match=r"^layer 'cat' reads blob 'c1', which the "
                                                r"memory plan shares .*keep=\['c1'\]"):
        planned.forward(start='cat')
    with pytest.raises(caffe.CaffeError, match=r"^layer 'bn1' runs 'scale1', 'relu1' with it "
                                                r"under memory_plan 'inplace_abn'"):
        planned.forward(start='scale1')
    with pytest.raises(caffe.CaffeError, match=r"^layer 'bn1' runs"):
        planned.forward(end='bn1')
    with pytest.raises(caffe.CaffeError, match=r"^layer 'pool' reads the diff of blob 'p'"):
        planned.backward(start='pool')
    got = planned.forward(start='conv2', end='conv2')
    np.testing.assert_array_equal(got['c2'], off.forward(start='conv2', end='conv2')['c2'])
    top_diff = rs.standard_normal(off.blobs['c2'].shape)
    for net in (off, planned):
        net.blobs['c2'].diff[...] = top_diff
        net.backward(start='conv2')
    for a, b in zip(off.learnable_params, planned.learnable_params):
        np.testing.assert_allclose(b.diff, a.diff, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(planned.blobs['x'].diff, off.blobs['x'].diff, rtol=1e-4, atol=1e-6)
    recomputing = caffe.Net(_text_param(FORK), caffe.TRAIN, memory_plan='recompute',
                            keep=['a', 'b'])
    recomputing.forward(x=inputs['x'][:, :, :8, :8])
    recomputing.backward(start='convB')    # the first to read bn1's output writes it again
    with pytest.raises(caffe.CaffeError, match=r"^layer 'convB' writes again, before its "
                                                r"backward, a blob the backward of layers up "
                                                r"to 'convA' reads"):
        recomputing.backward(start='convA')


FORK = '''name: "fork"
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "x" top: "c1" convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "bn1" type: "BatchNorm" bottom: "c1" top: "c1" }
layer { name: "scale1" type: "Scale" bottom: "c1" top: "c1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "convA" type: "Convolution" bottom: "c1" top: "a" convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "convB" type: "Convolution" bottom: "c1" top: "b" convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }
layer { name: "loss" type: "Reduction" bottom: "s" top: "loss" reduction_param { operation: SUMSQ } loss_weight: 1 }
'''
