"""Batch-norm forms: to_syncbn and to_batchnorm keep TEST outputs, round trips are exact,
and weights written in one form load into a net of another (convert/norm.py)."""
import numpy as np
import pytest
from helpers.model_weights import Deployed
from helpers.net_helpers import build

import caffe_syncbn as caffe
from caffe_syncbn.convert import to_batchnorm, to_syncbn
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.formats.caffemodel import read_weights
from caffe_syncbn.netparam.upgrade import load_net_param
from caffe_syncbn.weights.copy import arrays_of
from caffe_syncbn.weights.norm_forms import fit_norm_weights, statistics_factor

from helpers.paths import GOLDEN, require

RESNET = 'KaimingHe_deep-residual-networks__prototxt_ResNet-50-deploy.prototxt'
PSPNET = 'hszhao_PSPNet__evaluation_prototxt_pspnet50_ADE20K_473.prototxt'

BN_NET = '''name: "bn_net"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" batch_norm_param { eps: 0.001 } }
layer { name: "sc" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "bn2" type: "BatchNorm" bottom: "conv" top: "bn2" }
'''


def forward(param, weights, x, dtype=np.float32):
    net = caffe.Net(param, caffe.TEST, weights=weights, dtype=dtype)
    return {k: v.copy() for k, v in net.forward(**{net.inputs[0]: x}).items()}


def same_weights(a, b):
    assert list(a) == list(b)
    for name in a:
        assert len(a[name]) == len(b[name]), name
        for x, y in zip(a[name], b[name]):
            np.testing.assert_array_equal(x, y, err_msg=name)


def test_resnet50_batchnorm_scale_to_syncbn_and_back():
    resnet = Deployed(RESNET)
    param, synced = to_syncbn(resnet.param, resnet.weights)
    types = [layer.type for layer in param.layer]
    assert types.count('SyncBN') == 53 and 'Scale' not in types and 'BatchNorm' not in types
    resnet.check(resnet.forward(param, synced), 'to-syncbn')
    back, back_weights = to_batchnorm(param, synced)
    assert [layer.type for layer in back.layer].count('BatchNorm') == 53
    resnet.check(resnet.forward(back, back_weights), 'to-syncbn, then to-batchnorm')
    again, again_weights = to_syncbn(back, back_weights)     # SyncBN -> BatchNorm -> SyncBN
    assert again == param
    same_weights(again_weights, synced)


@pytest.mark.slow
def test_pspnet_bn_to_syncbn_and_batchnorm():
    pspnet = Deployed(PSPNET)
    param, synced = to_syncbn(pspnet.param, pspnet.weights)
    assert [layer.type for layer in param.layer].count('SyncBN') == 60
    for name, value in pspnet.forward(param, synced).items():
        np.testing.assert_array_equal(value, pspnet.expected[name])   # the same blobs as BN
    back, back_weights = to_batchnorm(pspnet.param, pspnet.weights)
    pspnet.check(pspnet.forward(back, back_weights), 'to-batchnorm')


def test_batchnorm_statistics_are_written_with_a_power_of_two_factor():
    assert statistics_factor(0.999) == 1024 and statistics_factor(0.9) == 8
    assert statistics_factor(0) == 1 and statistics_factor(1) == 1
    param, weights = to_syncbn(build(BN_NET).net_param, None)
    rs = np.random.RandomState(0)
    synced = {'conv': [rs.randn(4, 3, 3, 3), rs.randn(4)],
              'bn': [rs.uniform(0.5, 2, (1, 4, 1, 1)) for _ in range(4)],
              'bn2': [np.ones((1, 4, 1, 1)), np.zeros((1, 4, 1, 1)), rs.randn(1, 4, 1, 1),
                      rs.uniform(0.5, 2, (1, 4, 1, 1))]}
    synced = {k: [np.asarray(a, np.float32) for a in v] for k, v in synced.items()}
    back, written = to_batchnorm(param, synced)
    assert [l.name for l in back.layer if l.type == 'Scale'] == ['bn_scale', 'bn2_scale']
    mean, var, factor = written['bn']
    assert factor.tolist() == [1024.0]            # moving_average_fraction 0.999
    np.testing.assert_array_equal(mean, synced['bn'][2].reshape(-1) * 1024)
    np.testing.assert_array_equal(var, synced['bn'][3].reshape(-1) * 1024)
    np.testing.assert_array_equal(written['bn_scale'][0], synced['bn'][0].reshape(-1))
    bn = next(l for l in back.layer if l.name == 'bn')
    assert bn.batch_norm_param.eps == pytest.approx(0.001)


def test_caffe_batchnorm_with_factor_2_5_as_syncbn_matches_caffe(monkeypatch):
    """BVLC's own file: mean and var are stored times the scale factor 2.5."""
    require(GOLDEN / 'batchnorm_test_global_stats.prototxt')
    monkeypatch.chdir(GOLDEN)
    param, weights = to_syncbn('batchnorm_test_global_stats.prototxt',
                               'batchnorm_test_global_stats.caffemodel')
    ref = np.load('batchnorm_test_global_stats.npz')
    out = forward(param, weights, ref['input/x'])
    np.testing.assert_allclose(out['y'], ref['data/y'], rtol=1e-4, atol=1e-5)


# ---- loading weights of one form into a net of another ------------------------------
def golden_net(suffix):
    return str(require(GOLDEN / 'format_hdf5_caffemodel.prototxt')), \
        str(GOLDEN / ('format_hdf5_caffemodel' + suffix))


@pytest.mark.parametrize('suffix', ['.caffemodel', '.caffemodel.h5'])
def test_caffe_batchnorm_scale_weights_load_into_syncbn_net(suffix):
    prototxt, weights = golden_net(suffix)
    ref = np.load(GOLDEN / 'format_hdf5_caffemodel.npz')
    converted = to_syncbn(prototxt)[0]
    net = caffe.Net(converted, caffe.TEST)
    # HDF5 stores no layer types: the prototxt it was written for pairs BatchNorm and Scale
    from caffe_syncbn.weights.copy import copy_weights
    copy_weights(net, weights, source_layers=load_net_param(prototxt).layer)
    out = net.forward(data=ref['input/data'])
    np.testing.assert_allclose(out['prob'], ref['data/prob'], rtol=1e-4, atol=1e-5)
    if suffix == '.caffemodel':                  # a binary file says it itself
        out = caffe.Net(converted, caffe.TEST, weights=weights).forward(data=ref['input/data'])
        np.testing.assert_allclose(out['prob'], ref['data/prob'], rtol=1e-4, atol=1e-5)
    else:
        with pytest.raises(CaffeError, match=r"caffemodel.h5: layer 'bn1' holds BatchNorm .*"
                                             r"which Scale"):
            caffe.Net(converted, caffe.TEST, weights=weights)


def test_syncbn_weights_load_into_the_batchnorm_prototxt(tmp_path):
    prototxt, weights = golden_net('.caffemodel')
    ref = np.load(GOLDEN / 'format_hdf5_caffemodel.npz')
    synced = caffe.Net(to_syncbn(prototxt)[0], caffe.TEST, weights=weights)
    synced.save(str(tmp_path / 'synced.caffemodel'))
    synced.save_hdf5(str(tmp_path / 'synced.caffemodel.h5'))
    for saved in ('synced.caffemodel', 'synced.caffemodel.h5'):
        net = caffe.Net(prototxt, caffe.TEST, weights=str(tmp_path / saved))
        out = net.forward(data=ref['input/data'])
        np.testing.assert_allclose(out['prob'], ref['data/prob'], rtol=1e-4, atol=1e-5)
        # the SyncBN kept Caffe's sums and factor: they come back bitwise
        for mine, caffes in zip(net.params['bn1'], arrays_of(read_weights(weights))['bn1']):
            np.testing.assert_array_equal(mine.data, caffes)


def test_batchnorm_without_scale_cannot_take_a_slope():
    net = build(BN_NET, caffe.TEST)
    rs = np.random.RandomState(0)
    stored = {'bn2': [rs.uniform(0.5, 2, (1, 4, 1, 1)).astype(np.float32) for _ in range(4)]}
    with pytest.raises(CaffeError, match="<weights>: cannot load batch norm 'bn2'.*slope and "
                                         "bias cannot be held by BatchNorm 'bn2'.*no Scale"):
        net.copy_from(stored)
    stored['bn2'][0][...] = 1
    stored['bn2'][1][...] = 0
    net.copy_from(stored)
    np.testing.assert_array_equal(net.params['bn2'][0].data, stored['bn2'][2].reshape(-1) * 1024)


def test_fit_leaves_weights_of_the_right_form_alone():
    param = build(BN_NET, caffe.TEST).net_param
    stored = read_weights({'bn': [np.zeros(4), np.zeros(4), np.ones(1)], 'sc': [np.ones(4)]})
    assert fit_norm_weights(param.layer, stored.blobs) == stored.blobs
    bad = {'bn': [np.zeros(4), np.zeros(4)]}
    with pytest.raises(CaffeError, match="cannot load batch norm 'bn'.*2 blobs"):
        fit_norm_weights(to_syncbn(param)[0].layer, bad)


def test_frozen_norms_stay_frozen():
    text = BN_NET.replace('batch_norm_param { eps: 0.001 }',
                          'batch_norm_param { eps: 0.001 use_global_stats: true }')
    param = to_syncbn(build(text, caffe.TEST).net_param)[0]
    frozen = {l.name: l.bn_param.frozen for l in param.layer if l.type == 'SyncBN'}
    assert frozen == {'bn': True, 'bn2': False}
    back = to_batchnorm(param)[0]
    bn = next(l for l in back.layer if l.name == 'bn')
    assert bn.batch_norm_param.use_global_stats
    scale = next(l for l in back.layer if l.name == 'bn_scale')
    assert not scale.param        # learns, as the Scale after use_global_stats did in Caffe
    fork_text = BN_NET.replace('type: "BatchNorm" bottom: "conv" top: "bn2"',
                               'type: "BN" bottom: "conv" top: "bn2" bn_param { frozen: true }')
    fork = to_syncbn(build(fork_text, caffe.TEST).net_param)[0]
    bn2 = next(l for l in fork.layer if l.name == 'bn2')
    assert bn2.bn_param.frozen and [p.lr_mult for p in bn2.param] == [0, 0]


def test_converters_take_a_caffemodel_path(tmp_path):
    prototxt, weights = golden_net('.caffemodel.h5')
    param, synced = to_syncbn(prototxt, weights)     # HDF5: paired by the prototxt itself
    assert [a.shape for a in synced['bn1']] == [(1, 4, 1, 1)] * 4 + [(1,)]   # sums and s
    assert 'scale1' not in synced
    binary_param, from_binary = to_syncbn(prototxt, golden_net('.caffemodel')[1])
    assert param == binary_param and synced.keys() == from_binary.keys()
    for name in synced:                       # the same weights, whichever file held them
        for a, b in zip(synced[name], from_binary[name]):
            np.testing.assert_array_equal(a, b)
