"""SyncBN's two conventions of running statistics (bn_param.statistics): a SyncBN made of
a BatchNorm keeps BatchNorm's sums and scale factor (BATCHNORM) and trains, tests, converts,
folds and exports as BatchNorm + Scale; a BN or SyncBN prototxt keeps its momentum average."""
import logging

import numpy as np
import pytest
from helpers.net_helpers import build, input_layer

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.convert import fold_bn, to_batchnorm, to_syncbn
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.training.start_log import log_sync_bn

SHAPE = (4, 3, 5, 5)
BATCHNORM_SCALE = input_layer('data', *SHAPE) + '''
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 3 kernel_size: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv"
        batch_norm_param { moving_average_fraction: 0.9 eps: 0.001 } }
layer { name: "sc" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
'''
SYNCBN = BATCHNORM_SCALE.split('layer { name: "bn"')[0] + '''
layer { name: "bn" type: "SyncBN" bottom: "conv" top: "conv"
        bn_param { momentum: 0.9 eps: 0.001 %s } }
'''
SYNCBN_SUMS = SYNCBN % 'statistics: BATCHNORM'


def param_of(text):
    return parse_text(text, caffe_pb2.NetParameter())


def data(seed):
    """Inputs with a mean and spread far from 0 and 1."""
    return 3.0 + 2.0 * np.random.RandomState(seed).standard_normal(SHAPE)


def caffes_blobs(rng, channels=3):
    """BatchNorm's sums after some training (s not a power of two) and a Scale."""
    s = 7.4
    return {'conv': [rng.standard_normal((channels, SHAPE[1], 1, 1)),
                     rng.standard_normal(channels)],
            'bn': [rng.normal(3, 1, channels) * s, rng.uniform(1, 6, channels) * s, np.array([s])],
            'sc': [rng.uniform(0.5, 1.5, channels), rng.normal(0, 1, channels)]}


def as_float32(weights):
    return {k: [np.asarray(a, np.float32) for a in v] for k, v in weights.items()}


def test_to_syncbn_keeps_batchnorms_sums_and_the_forks_momentum():
    param = to_syncbn(param_of(BATCHNORM_SCALE))[0]
    bn = next(layer for layer in param.layer if layer.name == 'bn')
    assert bn.bn_param.statistics == caffe_pb2.BNParameter.BATCHNORM and bn.bn_param.momentum == pytest.approx(0.9)
    fork = param_of(BATCHNORM_SCALE.replace('type: "BatchNorm"', 'type: "BN"').replace(
        'batch_norm_param { moving_average_fraction: 0.9 eps: 0.001 }', 'bn_param { }'))
    synced = next(layer for layer in to_syncbn(fork)[0].layer if layer.name == 'bn')
    assert synced.bn_param.statistics == caffe_pb2.BNParameter.MOMENTUM


def test_syncbn_of_a_batchnorm_trains_and_tests_as_batchnorm_and_scale():
    """Float64, one device: SyncBN's blobs 2-4 follow BatchNorm's [mean_sum, var_sum, s]
    step by step (s = 1, 1.9, 2.71: Caffe's, not an average), and TEST outputs agree."""
    rng = np.random.default_rng(0)
    weights = caffes_blobs(rng)
    caffes = build(BATCHNORM_SCALE, dtype=np.float64)
    ours = caffe.Net(to_syncbn(param_of(BATCHNORM_SCALE))[0], caffe.TRAIN, dtype=np.float64)
    for name in ('conv', 'sc'):
        for blob, value in zip(caffes.params[name], weights[name]):
            blob.data[...] = value
    ours.copy_from({'conv': weights['conv'], 'bn': [
        weights['sc'][0].reshape(1, 3, 1, 1), weights['sc'][1].reshape(1, 3, 1, 1),
        np.zeros((1, 3, 1, 1)), np.zeros((1, 3, 1, 1)), np.zeros(1)]})
    for step in range(3):
        x = data(step)
        for net in (caffes, ours):
            net.forward(data=x)
        for mine, theirs in zip(ours.params['bn'][2:], caffes.params['bn']):
            np.testing.assert_allclose(mine.data.reshape(-1), theirs.data, rtol=1e-12)
        np.testing.assert_allclose(ours.blobs['conv'].data, caffes.blobs['conv'].data,
                                   rtol=1e-12, atol=1e-12)
    assert ours.params['bn'][4].data.tolist() == pytest.approx([2.71])
    tested = [caffe.Net(param, caffe.TEST, dtype=np.float64) for param in (
        param_of(BATCHNORM_SCALE), to_syncbn(param_of(BATCHNORM_SCALE))[0])]
    tested[0].share_with(caffes)
    tested[1].share_with(ours)
    x = data(5)
    outputs = [net.forward(data=x)['conv'].copy() for net in tested]
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('text', [SYNCBN % '', SYNCBN % 'statistics: MOMENTUM',
                                  SYNCBN.replace('SyncBN', 'BN') % ''])
def test_momentum_prototxts_keep_their_average(text):
    net = build(text, dtype=np.float64)
    x = data(0)
    net.forward(data=x)
    conv = np.einsum('ncij,kc->nkij', x, net.params['conv'][0].data.reshape(3, 3)) + \
        net.params['conv'][1].data.reshape(1, 3, 1, 1)
    mean, var = conv.mean(axis=(0, 2, 3)), conv.var(axis=(0, 2, 3))
    m = conv.size // 3
    if 'SyncBN' in text:
        var = var * m / (m - 1)
    blobs = net.params['bn']
    assert len(blobs) == 4
    np.testing.assert_allclose(blobs[2].data.reshape(-1), 0.1 * mean, rtol=1e-10)
    np.testing.assert_allclose(blobs[3].data.reshape(-1), 0.1 * var, rtol=1e-10)


def reference_output(weights, x):
    """BatchNorm + Scale, in TEST, on ``weights``."""
    net = build(BATCHNORM_SCALE, caffe.TEST)
    net.copy_from(weights)
    return net.forward(data=x)['conv'].copy()


def synced_weights(weights):
    """``weights`` as SYNCBN_SUMS holds them: slope, bias, mean_sum, var_sum, s."""
    per_channel = [np.reshape(a, (1, 3, 1, 1)) for a in weights['sc'] + weights['bn'][:2]]
    return {'conv': weights['conv'], 'bn': per_channel + [weights['bn'][2]]}


def test_batchnorms_sums_convert_to_syncbn_and_back_bitwise():
    weights = as_float32(caffes_blobs(np.random.default_rng(1)))
    synced = to_syncbn(param_of(BATCHNORM_SCALE), weights)[1]
    assert [a.shape for a in synced['bn']] == [(1, 3, 1, 1)] * 4 + [(1,)]
    for mine, theirs in zip(synced['bn'], synced_weights(weights)['bn']):
        np.testing.assert_array_equal(mine, theirs)
    back_param, back = to_batchnorm(param_of(SYNCBN_SUMS), synced_weights(weights))
    assert [layer.type for layer in back_param.layer] == ['Input', 'Convolution', 'BatchNorm',
                                                         'Scale']
    for mine, theirs in zip(back['bn'], weights['bn']):
        np.testing.assert_array_equal(mine, theirs)           # s = 7.4 stays, no 1024
    np.testing.assert_array_equal(back['bn_scale'][0], weights['sc'][0])


def test_momentum_syncbn_weights_load_into_a_syncbn_of_a_batchnorm():
    """Mean and var of a momentum SyncBN become sums over the power-of-two factor 8 of
    moving_average_fraction 0.9; TEST outputs stay."""
    weights = as_float32(caffes_blobs(np.random.default_rng(2)))
    synced = synced_weights(weights)
    s = weights['bn'][2][0]
    momentum = {'conv': synced['conv'], 'bn': synced['bn'][:2] + [
        (synced['bn'][2] / s).astype(np.float32), (synced['bn'][3] / s).astype(np.float32)]}
    net = caffe.Net(param_of(SYNCBN_SUMS), caffe.TEST, weights=momentum)
    assert net.params['bn'][4].data.tolist() == [8.0]
    x = data(3)
    np.testing.assert_allclose(net.forward(data=x)['conv'], reference_output(weights, x),
                               rtol=1e-5, atol=1e-5)


def test_fold_bn_of_a_syncbn_of_a_batchnorm():
    weights = as_float32(caffes_blobs(np.random.default_rng(3)))
    param, folded = fold_bn(param_of(SYNCBN_SUMS), synced_weights(weights))
    assert [layer.type for layer in param.layer] == ['Input', 'Convolution']
    net = caffe.Net(param, caffe.TEST, weights=folded)
    x = data(4)
    np.testing.assert_allclose(net.forward(data=x)['conv'], reference_output(weights, x),
                               rtol=1e-5, atol=1e-4)


def test_onnx_export_of_a_syncbn_of_a_batchnorm():
    pytest.importorskip('onnx')
    pytest.importorskip('onnxruntime')
    from helpers.onnx_helpers import run

    from caffe_syncbn.export import to_onnx
    weights = as_float32(caffes_blobs(np.random.default_rng(4)))
    model = to_onnx(param_of(SYNCBN_SUMS), synced_weights(weights))
    x = data(5).astype(np.float32)
    np.testing.assert_allclose(run(model, {'data': x})['conv'], reference_output(weights, x),
                               rtol=1e-5, atol=1e-4)


def test_sync_bn_says_how_each_layer_keeps_its_statistics(caplog):
    fork = BATCHNORM_SCALE + '''
layer { name: "bn2" type: "BN" bottom: "conv" top: "conv" }
'''
    with caplog.at_level(logging.INFO, logger='caffe_syncbn'):
        log_sync_bn(param_of(fork))
    assert ("running statistics of the global batch, kept 1 as BatchNorm's sums "
            '(moving_average_fraction) and 1 as a momentum average') in caplog.text
