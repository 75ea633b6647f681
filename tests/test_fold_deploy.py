"""fold_bn and to_deploy (convert/fold.py, convert/deploy.py), and the exports OpenCV 4 runs.

Small nets check the folding rules exactly, in float64. The corpus deploy nets, with
realistic random weights (model_weights.py), check that fold-bn and to-batchnorm give, in
our forward and in OpenCV's independent Caffe importer, what the original net gives.
"""
import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn.convert import fold_bn, to_batchnorm, to_deploy, to_syncbn
from caffe_syncbn.convert.command import write_net
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.net import load_net_param
from caffe_syncbn.upgrade import is_data_layer
from conftest import CORPUS, require
from model_weights import assert_close, realistic_weights, worst_error
from net_helpers import build

# ---- the folding rules, exactly ---------------------------------------------------------
INPUT = 'layer { name: "data" type: "Input" top: "data" input_param { shape { %s } } }\n'
CONV = ('layer { name: "%s" type: "Convolution" bottom: "%s" top: "%s" %s convolution_param '
        '{ num_output: 4 kernel_size: 3 pad: 1 %s } }\n')
BN = 'layer { name: "%s" type: "%s" bottom: "%s" top: "%s" }\n'
SCALE = 'layer { name: "%s" type: "Scale" bottom: "%s" top: "%s" scale_param { bias_term: true } }\n'
RELU = 'layer { name: "%s" type: "ReLU" bottom: "%s" top: "%s" }\n'
IMAGE = 'dim: 2 dim: 3 dim: 6 dim: 6'

CASES = {
    'conv_batchnorm_scale_in_place': (INPUT % IMAGE + CONV % ('c', 'data', 'c', '', '')
                                      + BN % ('bn', 'BatchNorm', 'c', 'c') + SCALE % ('s', 'c', 'c')
                                      + RELU % ('r', 'c', 'c'), 0),
    'conv_without_bias_bn_new_top': (INPUT % IMAGE + CONV % ('c', 'data', 'c', '', 'bias_term: false')
                                     + BN % ('bn', 'BN', 'c', 'n') + RELU % ('r', 'n', 'n'), 0),
    'deconv_groups_syncbn': (INPUT % IMAGE + 'layer { name: "d" type: "Deconvolution" bottom: '
                             '"data" top: "d" convolution_param { num_output: 6 group: 3 '
                             'kernel_size: 2 stride: 2 } }\n' + BN % ('bn', 'SyncBN', 'd', 'd'), 0),
    'inner_product_2d': (INPUT % 'dim: 3 dim: 5' + 'layer { name: "ip" type: "InnerProduct" bottom: '
                         '"data" top: "ip" inner_product_param { num_output: 4 } }\n'
                         + BN % ('bn', 'BatchNorm', 'ip', 'ip') + SCALE % ('s', 'ip', 'ip'), 0),
    'inner_product_transpose': (INPUT % 'dim: 3 dim: 5' + 'layer { name: "ip" type: "InnerProduct" '
                                'bottom: "data" top: "ip" inner_product_param { num_output: 4 '
                                'transpose: true } }\n' + BN % ('bn', 'BN', 'ip', 'ip'), 0),
    'two_norms_in_a_row': (INPUT % IMAGE + CONV % ('c', 'data', 'c', '', '')
                           + BN % ('bn', 'BN', 'c', 'c') + BN % ('bn2', 'SyncBN', 'c', 'c'), 0),
    # what cannot fold becomes one Scale:
    'after_relu': (INPUT % IMAGE + CONV % ('c', 'data', 'c', '', '') + RELU % ('r', 'c', 'c')
                   + BN % ('bn', 'BatchNorm', 'c', 'c') + SCALE % ('s', 'c', 'c'), 1),
    'conv_output_read_twice': (INPUT % IMAGE + CONV % ('c', 'data', 'c', '', '')
                               + BN % ('bn', 'BN', 'c', 'n')
                               + 'layer { name: "sum" type: "Eltwise" bottom: "c" bottom: "n" '
                                 'top: "sum" }\n', 1),
    'after_eltwise': (INPUT % IMAGE + CONV % ('c', 'data', 'c', '', '') + 'layer { name: "sum" '
                      'type: "Eltwise" bottom: "c" bottom: "data2" top: "sum" }\n'
                      + BN % ('bn', 'SyncBN', 'sum', 'sum'), 1),
    'inner_product_axis_2': (INPUT % 'dim: 2 dim: 3 dim: 5' + 'layer { name: "ip" type: '
                             '"InnerProduct" bottom: "data" top: "ip" inner_product_param { '
                             'num_output: 4 axis: 2 } }\n' + BN % ('bn', 'BN', 'ip', 'ip'), 1),
    'shared_weights': (INPUT % IMAGE + CONV % ('c', 'data', 'c', 'param { name: "w" }', '')
                       + CONV % ('c2', 'data', 'c2', 'param { name: "w" }', '')
                       + BN % ('bn', 'BN', 'c', 'c'), 1),
    'on_the_input': (INPUT % IMAGE + BN % ('bn', 'BatchNorm', 'data', 'n'), 1),
}
CASES['after_eltwise'] = (CASES['after_eltwise'][0].replace(
    'input_param { shape { %s } } }' % IMAGE,
    'input_param { shape { %s } } }\nlayer { name: "data2" type: "Input" top: "data2" '
    'input_param { shape { dim: 2 dim: 4 dim: 6 dim: 6 } } }' % IMAGE), 1)


def random_weights(net, rs):
    for name, layer in zip(net._layer_names, net.layers):
        for j, blob in enumerate(layer.blobs):
            if layer.type == 'BatchNorm':
                blob.data[...] = [rs.randn(*blob.shape), rs.uniform(0.5, 2, blob.shape),
                                  np.full(blob.shape, 2.5)][j]
            elif layer.type in ('BN', 'SyncBN'):
                blob.data[...] = rs.uniform(0.5, 2, blob.shape) if j in (0, 3) else \
                    rs.randn(*blob.shape)
            else:
                blob.data[...] = rs.randn(*blob.shape)
    return {name: [b.data.copy() for b in blobs] for name, blobs in net.params.items()}


def outputs(param, weights, inputs):
    net = caffe.Net(param, caffe.TEST, weights=weights, dtype=np.float64)
    return net.forward(**inputs)


@pytest.mark.parametrize('case', sorted(CASES))
def test_fold_bn_rules(case):
    text, scales = CASES[case]
    net = build(text, caffe.TEST, dtype=np.float64)
    rs = np.random.RandomState(0)
    weights = random_weights(net, rs)
    inputs = {name: rs.randn(*net.blobs[name].shape) for name in net.inputs}
    expected = outputs(net.net_param, weights, inputs)
    param, folded = fold_bn(net.net_param, weights)
    types = [layer.type for layer in param.layer]
    assert not {'BatchNorm', 'BN', 'SyncBN'} & set(types), types
    assert types.count('Scale') == scales, types
    got = outputs(param, folded, inputs)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-10, atol=1e-10)


def test_fold_bn_keeps_a_batchnorm_that_uses_batch_statistics():
    text = CASES['conv_batchnorm_scale_in_place'][0].replace(
        'type: "BatchNorm" bottom: "c" top: "c" }',
        'type: "BatchNorm" bottom: "c" top: "c" batch_norm_param { use_global_stats: false } }')
    net = build(text, caffe.TEST)
    param, _ = fold_bn(net.net_param, random_weights(net, np.random.RandomState(0)))
    assert [layer.type for layer in param.layer] == ['Input', 'Convolution', 'BatchNorm', 'Scale',
                                                      'ReLU']


def test_fold_bn_needs_the_statistics():
    net = build(CASES['after_relu'][0], caffe.TEST)
    with pytest.raises(CaffeError, match='needs the weights'):
        fold_bn(net.net_param, None)
    weights = random_weights(net, np.random.RandomState(0))
    del weights['bn']
    with pytest.raises(CaffeError, match="nothing for batch norm 'bn'"):
        fold_bn(net.net_param, weights)


# ---- the corpus deploy nets, against OpenCV ---------------------------------------------
cv2 = pytest.importorskip('cv2', reason='OpenCV is absent: pip install "opencv-python-headless<5"')

RESNET = 'KaimingHe_deep-residual-networks__prototxt_ResNet-50-deploy.prototxt'
PSPNET = 'hszhao_PSPNet__evaluation_prototxt_pspnet50_ADE20K_473.prototxt'
NETS = {
    'resnet50': (RESNET, (1, 3, 224, 224), ['fc1000']),
    'alexnet': ('BVLC_caffe__models_bvlc_alexnet_deploy.prototxt', (1, 3, 227, 227), ['fc8']),
    'caffenet': ('BVLC_caffe__models_bvlc_reference_caffenet_deploy.prototxt', (1, 3, 227, 227),
                 ['fc8']),
    'fcn8s': ('shelhamer_fcn.berkeleyvision.org__voc-fcn8s_deploy.prototxt', (1, 3, 96, 96),
              ['score']),
    'pspnet50': (PSPNET, (1, 3, 473, 473), ['conv6_interp']),
}
SLOW = {'pspnet50'}


class Reference:
    """A corpus net with realistic weights: our float64 outputs, and the float32 rounding
    error of our own forward, below which no float32 implementation can be held."""

    def __init__(self, key):
        name, shape, self.blobs = NETS[key]
        self.path = str(require(CORPUS / name))
        self.x = np.random.RandomState(1).uniform(-1, 1, shape).astype(np.float32)
        net = caffe.Net(self.path, caffe.TEST)
        self.weights = realistic_weights(net, {'data': self.x})
        ours32 = self.forward(self.path, self.weights)
        self.expected = self.forward(self.path, self.weights, np.float64)
        self.floor = {b: 4 * worst_error(ours32[b], self.expected[b])[0] for b in self.blobs}

    def forward(self, param, weights, dtype=np.float32):
        net = caffe.Net(param, caffe.TEST, weights=weights, dtype=dtype)
        net.forward(data=self.x)
        return {b: net.blobs[b].data.astype(np.float64) for b in self.blobs}

    def opencv(self, tmp_path, param, weights):
        paths = write_net(str(tmp_path / 'export'), param, weights)
        net = cv2.dnn.readNetFromCaffe(*paths)
        net.enableWinograd(False)      # 3-10x the float32 error of a direct convolution
        net.setInput(self.x)
        return dict(zip(self.blobs, net.forward(self.blobs)))

    def check(self, got, what):
        for blob in self.blobs:
            assert_close(got[blob], self.expected[blob], '%s %s' % (what, blob),
                         floor=self.floor[blob])


def corpus_params():
    return [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in NETS]


@pytest.mark.parametrize('key', corpus_params())
def test_corpus_exports_in_ours_and_opencv(key, tmp_path):
    """fold-bn, run by us and by OpenCV, and to-batchnorm of the SyncBN net, run by OpenCV,
    give the original net's outputs (one reference per net: its float64 forward is costly)."""
    ref = Reference(key)
    param, weights = fold_bn(ref.path, ref.weights)
    assert not {'BatchNorm', 'BN', 'SyncBN', 'Scale'} & {layer.type for layer in param.layer}
    ref.check(ref.forward(param, weights), 'fold-bn, ours')
    ref.check(ref.opencv(tmp_path, param, weights), 'fold-bn, OpenCV')
    param, weights = to_batchnorm(*to_syncbn(ref.path, ref.weights))
    ref.check(ref.opencv(tmp_path, param, weights), 'to-batchnorm, OpenCV')


# ---- to_deploy ----------------------------------------------------------------------------
def train_val_nets():
    if not CORPUS.exists():
        return ['<no corpus>']
    return sorted(p.name for p in CORPUS.glob('*.prototxt') if 'solver' not in p.name
                  and any(is_data_layer(l) for l in load_net_param(p).layer))


@pytest.mark.parametrize('name', train_val_nets())
def test_to_deploy_of_corpus_train_val_nets_builds_and_forwards(name):
    param = load_net_param(require(CORPUS / name))
    stages = sorted({s for l in param.layer for rule in l.include
                     if rule.phase == caffe.TEST for s in rule.stage})[:1]
    deploy, _ = to_deploy(param, stages=stages)
    types = [layer.type for layer in deploy.layer]
    assert not any(is_data_layer(layer) for layer in deploy.layer)
    assert 'Accuracy' not in types and 'SoftmaxWithLoss' not in types
    assert all(not layer.include and not layer.exclude for layer in deploy.layer)
    net = caffe.Net(deploy, caffe.TEST)
    rs = np.random.RandomState(0)
    out = net.forward(**{n: rs.rand(*net.blobs[n].shape) for n in net.inputs})
    assert out and all(np.isfinite(v).all() for v in out.values())
    if 'SoftmaxWithLoss' in {l.type for l in param.layer}:
        np.testing.assert_allclose(out['prob'].sum(axis=1), 1, rtol=1e-5)


def test_to_deploy_of_lenet_and_its_weights():
    path = require(CORPUS / 'BVLC_caffe__examples_mnist_lenet_train_test.prototxt')
    source = load_net_param(path)
    deploy, _ = to_deploy(source)
    data = deploy.layer[0]
    assert data.type == 'Input' and list(data.top) == ['data']
    assert list(data.input_param.shape[0].dim) == [100, 1, 28, 28]     # the TEST batch
    assert [l.name for l in deploy.layer][-1] == 'prob'
    shaped, _ = to_deploy(source, input_shape=(3, 1, 28, 28))
    assert list(shaped.layer[0].input_param.shape[0].dim) == [3, 1, 28, 28]
    reference = caffe.Net(shaped, caffe.TEST)
    rs = np.random.RandomState(0)
    weights = {name: [rs.randn(*b.shape).astype(np.float32) * 0.1 for b in blobs]
               for name, blobs in reference.params.items()}
    _, kept = to_deploy(source, weights, input_shape=(3, 1, 28, 28))
    assert list(kept) == list(weights)
    x = rs.rand(3, 1, 28, 28).astype(np.float32)
    prob = caffe.Net(shaped, caffe.TEST, weights=kept).forward(data=x)['prob']
    net = caffe.Net(shaped, caffe.TEST, weights=weights)
    np.testing.assert_array_equal(prob, net.forward(data=x)['prob'])
