"""to_syncbn: BatchNorm(+Scale) and BN become SyncBN, weights included, outputs unchanged."""
import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn.convert import to_syncbn
from caffe_syncbn.net import load_net_param
from conftest import CORPUS, GOLDEN, require

RESNET = 'KaimingHe_deep-residual-networks__prototxt_ResNet-50-deploy.prototxt'
PSPNET = 'hszhao_PSPNet__evaluation_prototxt_pspnet50_ADE20K_473.prototxt'


def randomize(net, rs):
    """Random weights everywhere; BN variances positive, BatchNorm scale factors set."""
    for name, blobs in net.params.items():
        kind = net.layer_by_name[name].type
        for i, blob in enumerate(blobs):
            values = rs.standard_normal(blob.shape) * 0.1
            if kind == 'BatchNorm':
                values = [rs.standard_normal(blob.shape) * 0.1, rs.uniform(0.5, 1.5, blob.shape),
                          np.full(blob.shape, 0.5)][i]
            elif kind == 'BN':
                values = [rs.uniform(0.5, 1.5, blob.shape), values,
                          values, rs.uniform(0.5, 1.5, blob.shape)][i]
            elif kind == 'Scale' and i == 0:
                values = rs.uniform(0.5, 1.5, blob.shape)
            blob.data[...] = values


def weights_of(net):
    return {name: [b.data.copy() for b in blobs] for name, blobs in net.params.items()}


def load(net, weights):
    for name, arrays in weights.items():
        for blob, array in zip(net.params.get(name, []), arrays):
            blob.data[...] = array


def converted_outputs_match(prototxt, shape, tolerance):
    original = caffe.Net(prototxt, caffe.TEST)
    randomize(original, np.random.RandomState(0))
    param, weights = to_syncbn(load_net_param(prototxt), weights_of(original))
    assert not [l.name for l in param.layer if l.type in ('BatchNorm', 'BN', 'Scale')
                and l.type != 'Scale'], 'every batch norm became SyncBN'
    converted = caffe.Net(param, caffe.TEST)
    load(converted, weights)
    x = np.random.RandomState(1).standard_normal(shape).astype(np.float32)
    expected = original.forward(**{original.inputs[0]: x})
    actual = converted.forward(**{converted.inputs[0]: x})
    assert expected.keys() == actual.keys()
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=tolerance, atol=tolerance)
    return param


def test_resnet50_batchnorm_scale_to_syncbn():
    require(CORPUS / RESNET)
    param = converted_outputs_match(str(CORPUS / RESNET), (1, 3, 224, 224), 1e-4)
    types = [l.type for l in param.layer]
    assert types.count('SyncBN') == 53 and 'Scale' not in types


@pytest.mark.slow
def test_pspnet_bn_to_syncbn():
    require(CORPUS / PSPNET)
    param = converted_outputs_match(str(CORPUS / PSPNET), (1, 3, 473, 473), 1e-4)
    assert [l.type for l in param.layer].count('SyncBN') == 60


def test_golden_batchnorm_net_converts(monkeypatch):
    """A net with a BatchNorm that has no Scale after it, trained stats in the caffemodel."""
    require(GOLDEN / 'inplace_conv_bn_scale_relu.prototxt')
    monkeypatch.chdir(GOLDEN)
    param, weights = to_syncbn(load_net_param('batchnorm_test_global_stats.prototxt'),
                               'batchnorm_test_global_stats.caffemodel')
    net = caffe.Net(param, caffe.TEST)
    load(net, weights)
    ref = np.load('batchnorm_test_global_stats.npz')
    inputs = {k.split('/', 1)[1]: ref[k] for k in ref.files if k.startswith('input/')}
    out = net.forward(**inputs)
    for name, value in out.items():
        np.testing.assert_allclose(value, ref['data/' + name], rtol=1e-4, atol=1e-5)
