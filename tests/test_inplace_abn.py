"""memory_plan='inplace_abn': a batch norm absorbs the Scale and ReLU after it, runs them in
one pass and, in place, finds x_hat from the chain's output in the backward instead of
keeping a copy; 'recompute' also writes again in the backward the outputs of the chains
that keep x_hat. The gradients stay those of memory_plan 'off' within float32 rounding (and
1e-10 in float64), on the host, on the CUDA kernels in the emulation, and over 10 solver
iterations under SyncBN on 2 devices; planned buffers start as NaN bytes."""
import logging

import numpy as np
import pytest
from helpers.cuda_emulation import emulated_kernels

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2, memory_plan
from caffe_syncbn.backend import cuda_kernels, to_numpy
from caffe_syncbn.analysis.timing import timing_net_param
from caffe_syncbn.layer import LayerContext
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.training.solvers import get_solver
from helpers.paths import ROOT
from test_data_parallel import batches, check_replicas_equal_one
from test_data_parallel import solver_param as data_parallel_solver
from test_memory_plan import random_param


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    monkeypatch.setattr(memory_plan, 'new_buffer',
                        lambda xp, nbytes: xp.full(nbytes, 0xFF, np.uint8))


HEADS = {   # the layers after conv1, written in place or apart
    'BatchNorm+Scale': '''
layer { name: "bn1" type: "BatchNorm" bottom: "c1" top: "%(bn)s" }
layer { name: "sc1" type: "Scale" bottom: "%(bn)s" top: "%(sc)s" scale_param { bias_term: true } }''',
    'BatchNorm(global)+Scale': '''
layer { name: "bn1" type: "BatchNorm" bottom: "c1" top: "%(bn)s"
        batch_norm_param { use_global_stats: true } }
layer { name: "sc1" type: "Scale" bottom: "%(bn)s" top: "%(sc)s" scale_param { bias_term: true } }''',
    'BN': '''
layer { name: "bn1" type: "BN" bottom: "c1" top: "%(sc)s" bn_param { momentum: 0.9 } }''',
    'SyncBN': '''
layer { name: "bn1" type: "SyncBN" bottom: "c1" top: "%(sc)s" bn_param { momentum: 0.9 } }''',
    "NVCaffe's BatchNorm": '''
layer { name: "bn1" type: "BatchNorm" bottom: "c1" top: "%(sc)s"
        batch_norm_param { scale_bias: true moving_average_fraction: 0.9 } }''',
}

NET = '''name: "chain"
layer { name: "in" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "x" top: "c1"
        convolution_param { num_output: 5 kernel_size: 3 pad: 1 } }
%(head)s
%(relu)s
layer { name: "conv2" type: "Convolution" bottom: "%(out)s" top: "c2"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "pool" type: "Pooling" bottom: "c2" top: "pool"
        pooling_param { pool: AVE global_pooling: true } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "pool" bottom: "label" top: "loss" }
'''


def chain_net(head, slope, in_place):
    names = {'bn': 'c1', 'sc': 'c1', 'out': 'c1'} if in_place else \
        {'bn': 'bn1', 'sc': 'sc1', 'out': 'r1' if slope is not None else 'sc1'}
    relu = '' if slope is None else (
        'layer { name: "relu1" type: "ReLU" bottom: "%s" top: "%s" relu_param { negative_slope: %g } }'
        % (names['sc'], names['out'], slope))
    return NET % dict(names, head=HEADS[head] % names, relu=relu)


def twins(text, dtype=np.float32, kernels=False, plans=('off', 'inplace_abn')):
    nets = [caffe.Net(parse_text(text, caffe_pb2.NetParameter()), caffe.TRAIN, memory_plan=plan,
                      context=LayerContext(dtype=dtype, cuda_kernels=kernels and plan != 'off'))
            for plan in plans]
    rs = np.random.RandomState(0)
    for params in zip(*(net.learnable_params for net in nets)):
        value = rs.uniform(0.5, 1.5, params[0].shape) if params[0].count < 8 else \
            rs.standard_normal(params[0].shape) * 0.5
        for blob in params:
            blob.data[...] = value
    return nets


def run(nets, steps=2, seed=1):
    rs = np.random.RandomState(seed)
    x, label = rs.standard_normal((4, 3, 6, 6)) * 2 + 1, np.array([0, 3, 1, 2.0])
    for net in nets:
        for _ in range(steps):       # the second step normalizes with updated statistics
            net.blobs['x'].data[...] = x
            net.blobs['label'].data[...] = label
            net.clear_param_diffs()
            net.forward_prefilled()
            net.backward_from()


def assert_same_gradients(reference, fused, tol):
    """Equal losses, weights and param diffs within ``tol``, diffs relative to the largest
    of their blob (or of the net's, where a blob's true gradient is 0: a bias before a
    batch norm)."""
    assert float(fused.blobs['loss'].data) == pytest.approx(float(reference.blobs['loss'].data),
                                                            rel=tol)
    largest = max(float(np.abs(to_numpy(a.diff)).max()) for a in reference.learnable_params)
    for j, (a, b) in enumerate(zip(reference.learnable_params, fused.learnable_params)):
        scale = max(float(np.abs(to_numpy(a.diff)).max()), 1e-3 * largest)
        np.testing.assert_allclose(to_numpy(b.data), to_numpy(a.data), rtol=tol, atol=tol)
        np.testing.assert_allclose(to_numpy(b.diff), to_numpy(a.diff), rtol=tol, atol=tol * scale,
                                   err_msg='param %d' % j)


@pytest.mark.parametrize('head', sorted(HEADS))
@pytest.mark.parametrize('slope', [None, 0.0, 0.1])
@pytest.mark.parametrize('in_place', [True, False])
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('plan', ['inplace_abn', 'recompute'])
def test_a_chain_gives_the_gradients_of_off(head, slope, in_place, dtype, plan):
    reference, fused = twins(chain_net(head, slope, in_place), dtype, plans=('off', plan))
    run([reference, fused])
    assert_same_gradients(reference, fused, 2e-5 if dtype == np.float32 else 1e-10)
    bn = fused.layer_by_name['bn1']
    absorbed = [fused._layer_names[k] for k in fused.planner.chains[fused._layer_names.index('bn1')]]
    assert absorbed == (['sc1'] if 'Scale' in head else []) + \
        (['relu1'] if slope is not None else [])
    # in place, only the batch formula after a ReLU of slope 0 makes the chain keep x_hat;
    # apart, x_hat is made again from the input, which stays
    assert bn._recovered == (in_place and bool(absorbed) and
                             (slope != 0.0 or head == 'BatchNorm(global)+Scale'))
    kept = [array for layer in fused.layers for array in
            (getattr(layer, '_x_hat_buffer', None), getattr(layer, '_input_copy', None))
            if array is not None]
    assert len(kept) == (1 if in_place and not bn._recovered else 0)
    # what keeps x_hat in place writes its output again for the backward
    written_again = [fused._layer_names[fused.layers.index(layer)]
                     for layer in fused.planner.recomputers.values()]
    assert written_again == (['bn1'] if plan == 'recompute' and in_place and slope != 0.1 and
                             head != 'BatchNorm(global)+Scale' and
                             not (head == 'BatchNorm+Scale' and slope is None) else [])


def test_gamma_near_zero_keeps_x_hat_and_says_so_once(caplog):
    reference, fused = twins(chain_net('BatchNorm+Scale', 0.1, True))
    for net in (reference, fused):
        net.params['sc1'][0].data[2] = 1e-3          # |beta| > 64 |gamma| on channel 2
    with caplog.at_level(logging.INFO, logger='caffe_syncbn'):
        run([reference, fused], steps=3)
    assert fused.layer_by_name['bn1']._recovered is False
    assert [r.getMessage() for r in caplog.records if 'gamma' in r.getMessage()] == [
        "layer 'bn1': a channel's gamma is (near) zero against its beta: the backward keeps "
        'x_hat instead of finding it from the output']
    assert_same_gradients(reference, fused, 2e-5)


def test_an_output_a_later_layer_overwrites_is_not_recovered_from():
    text = chain_net('BN', 0.1, True).replace(
        'layer { name: "conv2"',
        'layer { name: "drop" type: "Dropout" bottom: "c1" top: "c1" dropout_param { dropout_ratio: 0 } }\n'
        'layer { name: "conv2"')
    reference, fused = twins(text)
    run([reference, fused])
    bn = fused.layer_by_name['bn1']
    assert bn.chain is not None and not bn.output_survives and bn._recovered is False
    assert_same_gradients(reference, fused, 2e-5)


def test_a_kept_or_shared_blob_ends_the_chain():
    text = chain_net('BatchNorm+Scale', 0.0, False)
    net = caffe.Net(parse_text(text, caffe_pb2.NetParameter()), caffe.TRAIN,
                    memory_plan='inplace_abn', keep=['sc1'])
    assert [net._layer_names[k] for k in net.planner.chains[net._layer_names.index('bn1')]] == ['sc1']


def test_a_forward_only_net_fuses_the_inference_chain():
    text = chain_net('BatchNorm+Scale', 0.0, True)
    nets = [caffe.Net(parse_text(text, caffe_pb2.NetParameter()), caffe.TEST, memory_plan=plan)
            for plan in ('off', 'inplace_abn')]
    rs = np.random.RandomState(3)
    for a, b in zip(*(net.learnable_params for net in nets)):
        a.data[...] = rs.uniform(0.5, 1.5, a.shape)
        b.data[...] = a.data
    x = rs.standard_normal((4, 3, 6, 6))
    outputs = [net.forward(x=x, label=np.zeros(4))['loss'] for net in nets]
    assert nets[1].planner.chains[nets[1]._layer_names.index('bn1')] != []
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-6)


@pytest.mark.parametrize('head', ['BatchNorm+Scale', 'BatchNorm(global)+Scale', 'SyncBN'])
@pytest.mark.parametrize('slope', [None, 0.0, 0.1])
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('plan', ['inplace_abn', 'recompute'])
def test_the_cuda_chain_in_the_emulation_gives_the_host_gradients(monkeypatch, head, slope, dtype,
                                                                  plan):
    emulated_kernels(monkeypatch)
    called = set()
    original = cuda_kernels.kernel
    monkeypatch.setattr(cuda_kernels, 'kernel',
                        lambda stem, name: called.add(name.rsplit('_', 1)[0]) or original(stem, name))
    reference, fused = twins(chain_net(head, slope, True), dtype, kernels=True,
                             plans=('off', plan))
    run([reference, fused])
    assert_same_gradients(reference, fused, 2e-4 if dtype == np.float32 else 1e-10)
    assert bool(fused.planner.recomputers) == (plan == 'recompute' and (
        slope is None and head == 'SyncBN' or slope == 0 and head != 'BatchNorm(global)+Scale'))
    fused_kernels = {name for name in called if name.startswith('fused_')}
    if head == 'SyncBN' and slope is None:       # nothing to absorb; recompute writes y again
        assert fused_kernels == ({'fused_affine_relu'} if plan == 'recompute' else set())
    elif slope is None or slope > 0 or head == 'BatchNorm(global)+Scale':
        want = {'fused_bn_relu_backward_reduce', 'fused_bn_relu_backward_dx'}
        assert want <= fused_kernels and (slope is None or 'fused_bn_relu_forward' in fused_kernels)
        assert 'fused_eltwise_sum_relu_backward' not in fused_kernels
    else:
        assert fused_kernels == {'fused_affine_relu', 'fused_eltwise_sum_relu_backward'}


def test_resnet50_gives_the_gradients_of_off():
    """Every BatchNorm + Scale + ReLU of ResNet-50 (use_global_stats, as the file has it)
    becomes a chain that keeps nothing."""
    param = timing_net_param(ROOT / 'examples' / 'resnet50' / 'ResNet-50-deploy.prototxt', batch=2)
    reference, fused = (caffe.Net(param, caffe.TRAIN, memory_plan=plan)
                        for plan in ('off', 'inplace_abn'))
    rs = np.random.RandomState(0)
    for a, b in zip(reference.learnable_params, fused.learnable_params):
        a.data[...] = random_param(rs, a.shape)
        b.data[...] = a.data
    x = rs.uniform(0, 3, reference.blobs['data'].shape)
    for net in (reference, fused):
        net.blobs['data'].data[...] = x
        net.forward_prefilled()
        net.blobs['prob'].diff[...] = np.eye(1000)[[3, 7]] - net.blobs['prob'].data
        net.backward_from()
    assert sum(map(len, fused.planner.chains)) == 53 + 33 + 16    # Scales, ReLUs after them and after the sums
    assert all(layer._recovered for layer in fused.layers if getattr(layer, 'chain', None))
    for j, (a, b) in enumerate(zip(reference.learnable_params, fused.learnable_params)):
        scale = max(float(np.abs(a.diff).max()), 1e-6)
        np.testing.assert_allclose(b.diff, a.diff, rtol=1e-3, atol=2e-5 * scale,
                                   err_msg='param %d' % j)


@pytest.mark.slow
def test_resnet50_with_batch_statistics_is_as_close_to_float64_as_off():
    """With batch statistics, a deep net at batch 2 magnifies float32 rounding: each plan's
    gradients are measured against float64 'off', and may be no further from it than
    float32 'off' is (recompute: bitwise inplace_abn's)."""
    param = timing_net_param(ROOT / 'examples' / 'resnet50' / 'ResNet-50-deploy.prototxt', batch=2)
    for layer in param.layer:
        if layer.type == 'BatchNorm':
            layer.batch_norm_param.ClearField('use_global_stats')
    nets = [caffe.Net(param, caffe.TRAIN, memory_plan=plan, context=LayerContext(dtype=dtype))
            for plan, dtype in (('off', np.float64), ('off', np.float32),
                                ('inplace_abn', np.float32), ('recompute', np.float32))]
    rs = np.random.RandomState(0)
    for params in zip(*(net.learnable_params for net in nets)):
        value = random_param(rs, params[0].shape)
        for blob in params:
            blob.data[...] = value
    x = rs.uniform(0, 3, (2, 3, 224, 224))
    for net in nets:
        net.blobs['data'].data[...] = x
        net.forward_prefilled()
        net.blobs['prob'].diff[...] = np.eye(1000)[[3, 7]] - net.blobs['prob'].data
        net.backward_from()
    assert len(nets[3].planner.recomputers) == 33               # the chains with a ReLU

    def error(net):
        return max(float(np.abs(a.diff - b.diff).max() / max(np.abs(a.diff).max(), 1e-6))
                   for a, b in zip(nets[0].learnable_params, net.learnable_params))
    assert error(nets[2]) <= 1.5 * error(nets[1]) + 1e-5
    for a, b in zip(nets[2].learnable_params, nets[3].learnable_params):
        np.testing.assert_array_equal(b.diff, a.diff)


def train(plan, steps=10):
    solver = get_solver(data_parallel_solver('SyncBN'), devices='cpu:2', sync_bn=True,
                        memory_plan=plan)
    feed = iter(batches(steps))
    solver.set_data_source(lambda: next(feed))
    solver.step(steps)
    weights = [to_numpy(b.data).copy() for layer in solver.net.layers for b in layer.blobs]
    chains = solver.net.planner.chains
    solver.close()
    return weights, chains


@pytest.mark.parametrize('plan', ['share', 'inplace_abn', 'recompute', 'auto'])
def test_four_devices_equal_one_device_on_the_whole_batch_under_a_plan(plan):
    check_replicas_equal_one('cpu:1', 'cpu:4', (7, 0, 6, 3), memory_plan=plan)


@pytest.mark.parametrize('plan', ['inplace_abn', 'recompute', 'auto'])
def test_ten_solver_iterations_under_syncbn_on_two_devices_stay_within_float32_rounding(plan):
    (reference, _), (fused, chains) = train('off'), train(plan)
    assert any(chains)
    for a, b in zip(reference, fused):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(a).max())))


RESIDUAL = '''name: "residual"
layer { name: "in" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "x" top: "a"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "conv2" type: "Convolution" bottom: "x" top: "b"
        convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "%(sum)s"
        eltwise_param { operation: SUM %(coeff)s } }
layer { name: "relu" type: "ReLU" bottom: "%(sum)s" top: "%(out)s" relu_param { negative_slope: %(slope)g } }
layer { name: "pool" type: "Pooling" bottom: "%(out)s" top: "pool"
        pooling_param { pool: AVE global_pooling: true } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "pool" bottom: "label" top: "loss" }
'''


@pytest.mark.parametrize('slope', [0.0, 0.1])
@pytest.mark.parametrize('in_place', [True, False])
@pytest.mark.parametrize('coeff', ['', 'coeff: 1 coeff: -0.5'])
@pytest.mark.parametrize('kernels', [False, True])
def test_an_eltwise_sum_absorbs_its_relu(monkeypatch, slope, in_place, coeff, kernels):
    emulated_kernels(monkeypatch)
    called = set()
    original = cuda_kernels.kernel
    monkeypatch.setattr(cuda_kernels, 'kernel',
                        lambda stem, name: called.add(name.rsplit('_', 1)[0]) or original(stem, name))
    text = RESIDUAL % {'sum': 's', 'out': 's' if in_place else 'r', 'coeff': coeff, 'slope': slope}
    reference, fused = twins(text, kernels=kernels)
    run([reference, fused])
    assert fused.planner.chains[fused._layer_names.index('sum')] == [fused._layer_names.index('relu')]
    assert_same_gradients(reference, fused, 2e-5)
    assert ({'fused_eltwise_sum_relu', 'fused_eltwise_sum_relu_backward'} <= called) == kernels
