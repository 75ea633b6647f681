"""fold_bn and to_deploy (convert/fold.py, convert/deploy.py).

Small nets check the folding rules exactly, in float64; test_corpus_exports.py runs the
corpus deploy nets through fold-bn in ours and in OpenCV. to_deploy builds and runs every
train_val net of the corpus, its data layers reading small files written for them.
"""
import numpy as np
import pytest
from helpers.data_sources import write_sources
from google.protobuf import text_format
from helpers.net_helpers import build

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.convert import fold_bn, to_deploy
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.netparam.inputs import is_data_layer
from caffe_syncbn.netparam.upgrade import load_net_param

from helpers.paths import CORPUS, require

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
    net = build(CASES['conv_batchnorm_scale_in_place'][0], caffe.TEST)
    weights = random_weights(net, np.random.RandomState(0))
    weights['c'] = [np.ones((5, 3, 3, 3)), np.ones(5)]           # another net's weights
    with pytest.raises(CaffeError, match=r"layer 'c' blob 0 has shape \[5, 3, 3, 3\] in the "
                                         r'weights but \[4, 3, 3, 3\] in the net: the weights '
                                         'are for another net$'):
        fold_bn(net.net_param, weights)


# ---- to_deploy ----------------------------------------------------------------------------
def train_val_nets():
    if not CORPUS.exists():
        return ['<no corpus>']
    return sorted(p.name for p in CORPUS.glob('*.prototxt') if 'solver' not in p.name
                  and any(is_data_layer(l) for l in load_net_param(p).layer))


#: (C, H, W) of the records written for each net's data layers, and its deploy input
SAMPLES = {
    'BVLC_caffe__examples_mnist_lenet_train_test.prototxt': ((1, 28, 28), (100, 1, 28, 28)),
    'BVLC_caffe__examples_mnist_mnist_autoencoder.prototxt': ((1, 28, 28), (100, 1, 28, 28)),
    'BVLC_caffe__examples_cifar10_cifar10_full_sigmoid_train_test_bn.prototxt':
        ((3, 32, 32), (1000, 3, 32, 32)),
    'BVLC_caffe__models_bvlc_alexnet_train_val.prototxt': ((3, 256, 256), (50, 3, 227, 227)),
    'BVLC_caffe__examples_hdf5_classification_train_val.prototxt': ((4,), (10, 4)),
    'yjxiong_caffe__models_semantic_segmentation_fcn_vgg_16_train.prototxt':
        ((3, 70, 100), (1, 3, 64, 96)),          # trimmed to multiples of its stride, 32
}


@pytest.mark.parametrize('name', train_val_nets())
def test_to_deploy_of_corpus_train_val_nets_builds_and_forwards(name, tmp_path, monkeypatch):
    """Each net's data layers read files written where its prototxt names them; the
    deploy net's input is what they hold, cropped, at the TEST batch size."""
    param = load_net_param(require(CORPUS / name))
    stages = sorted({s for l in param.layer for rule in l.include
                     if rule.phase == caffe.TEST for s in rule.stage})[:1]
    sample, expected = SAMPLES[name]
    monkeypatch.chdir(tmp_path)
    write_sources(param, sample)
    deploy, _ = to_deploy(param, stages=stages)
    assert tuple(deploy.layer[0].input_param.shape[0].dim) == expected
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


def test_to_deploy_of_lenet_and_its_weights(tmp_path, monkeypatch):
    path = require(CORPUS / 'BVLC_caffe__examples_mnist_lenet_train_test.prototxt')
    source = load_net_param(path)
    monkeypatch.chdir(tmp_path)
    write_sources(source, (1, 28, 28))
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


# ---- HDF5 weights with shared params ------------------------------------------------------
def test_converters_read_hdf5_weights_whose_shared_params_only_the_owner_holds(tmp_path):
    """Caffe's HDF5 stores a shared param under its owner only: c2, which shares c's weight
    but has its own bias, holds blob 1 alone. Every converter must put the weight back in
    place, not move the bias to blob 0, and write the result as Caffe would."""
    import h5py

    from caffe_syncbn.convert import to_batchnorm, to_syncbn
    from caffe_syncbn.cli.convert import write_net
    text = (INPUT % IMAGE + CONV % ('c', 'data', 'c', 'param { name: "w" }', '')
            + CONV % ('c2', 'data', 'c2', 'param { name: "w" }', '')
            + BN % ('bn', 'BatchNorm', 'c2', 'c2') + SCALE % ('s', 'c2', 'c2'))
    net = build(text, caffe.TEST, dtype=np.float64)
    rs = np.random.RandomState(0)
    random_weights(net, rs)
    path = str(tmp_path / 'shared.caffemodel.h5')
    net.save_hdf5(path)
    with h5py.File(path, 'r') as f:
        assert sorted(f['data/c2']) == ['1']           # as Caffe writes it
    inputs = {'data': rs.randn(*net.blobs['data'].shape)}
    expected = net.forward(**inputs)['c2'].copy()
    for convert in (to_deploy, fold_bn, to_syncbn, to_batchnorm):
        param, weights = convert(net.net_param, path)
        for hdf5 in (False, True):
            prefix = str(tmp_path / ('%s_%d' % (convert.__name__, hdf5)))
            _, written = write_net(prefix, param, weights, hdf5=hdf5)
            got = outputs(prefix + '.prototxt', written, inputs)['c2']
            np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9, err_msg=prefix)


def test_the_prototxts_own_stages_count_as_in_a_net():
    """``state { stage: ... }`` in the file selects layers for Net, fold_bn and to_deploy
    alike, with the stages given added to it."""
    text = ('state { stage: "deploy" }\n' + INPUT % IMAGE
            + 'layer { name: "r" type: "ReLU" bottom: "data" top: "r"\n'
              '        include { stage: "deploy" } }\n'
            + 'layer { name: "t" type: "TanH" bottom: "data" top: "t"\n'
              '        include { stage: "fast" } }\n')
    assert build(text, caffe.TEST).outputs == ['r']
    assert build(text, caffe.TEST, stages=['fast']).outputs == ['r', 't']
    source = text_format.Parse(text, caffe_pb2.NetParameter())
    assert [l.name for l in to_deploy(source)[0].layer] == ['data', 'r']
    assert [l.name for l in to_deploy(source, stages=['fast'])[0].layer] == ['data', 'r', 't']
    assert [l.name for l in fold_bn(source, {})[0].layer] == ['data', 'r']
