"""The Net: pycaffe's API, NetState rules, legacy formats, in-place and Split layers, Python
layers and NetSpec. tests/test_net_backward.py covers sharing, loss weights and backward rules.

Expectations come from small numpy computations written here, never from the code under test.
"""
import collections
import json

import numpy as np
import pytest
from google.protobuf import text_format
from helpers.net_helpers import (MLP, build, close, input_layer, ip_layer, load_pylayers,
                                 mlp_reference, python_layer, randomize)

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.pycaffe.net_spec import NetSpec, layers as L, params as P, to_proto

from helpers.paths import GOLDEN


@pytest.fixture
def pylayers(monkeypatch):
    return load_pylayers(monkeypatch)


# ---- construction and the pycaffe API ------------------------------------------------------
def test_constructor_forms_and_weights(tmp_path):
    model = tmp_path / 'mlp.prototxt'
    model.write_text(MLP)
    net = caffe.Net(str(model), caffe.TEST)
    randomize(net)
    weights = tmp_path / 'mlp.caffemodel'
    net.save(str(weights))
    for other in (caffe.Net(str(model), caffe.TEST, weights=str(weights)),
                  caffe.Net(str(model), str(weights), caffe.TEST),          # pycaffe's old form
                  caffe.Net(model, caffe.TRAIN, weights=weights)):          # pathlib works too
        for name, blobs in net.params.items():
            for a, b in zip(blobs, other.params[name]):
                np.testing.assert_array_equal(a.data, b.data)
    assert caffe.Net(str(model), str(weights), caffe.TEST).phase == caffe.TEST
    with pytest.raises(CaffeError, match='phase'):
        caffe.Net(str(model))
    with pytest.raises(CaffeError, match='missing.prototxt'):
        caffe.Net(str(tmp_path / 'missing.prototxt'), caffe.TEST)


def test_blobs_params_layers_and_names():
    net = build(MLP)
    assert isinstance(net.blobs, collections.OrderedDict)
    assert list(net.blobs) == ['data', 'ip1', 'ip2', 'prob']
    assert isinstance(net.params, collections.OrderedDict)
    assert list(net.params) == ['ip1', 'ip2']
    assert [b.shape for b in net.params['ip1']] == [(5, 12), (5,)]
    assert [b.shape for b in net.params['ip2']] == [(4, 5), (4,)]
    assert list(net._layer_names) == ['data', 'ip1', 'relu1', 'ip2', 'prob']
    assert [layer.type for layer in net.layers] == ['Input', 'InnerProduct', 'ReLU', 'InnerProduct',
                                                    'Softmax']
    assert net.inputs == ['data'] and net.outputs == ['prob']
    assert net.top_names['relu1'] == ['ip1'] and net.bottom_names['relu1'] == ['ip1']
    assert net.bottom_names['ip2'] == ['ip1'] and net.top_names['data'] == ['data']
    blob = net.blobs['data']
    assert blob.shape == (2, 3, 2, 2) and blob.count == 24 and blob.data.dtype == np.float32
    assert blob.diff.shape == blob.shape
    assert {'InnerProduct', 'Python', 'Split', 'Input'} <= set(caffe.layer_type_list())


def test_outputs_follow_caffe_rules():
    """Outputs: blobs nobody consumed, an in-place layer's top included, sorted by name."""
    net = build(input_layer('x', 2, 3)
                + 'layer { name: "z" type: "ReLU" bottom: "x" top: "zz" }\n'
                + 'layer { name: "a" type: "TanH" bottom: "x" top: "aa" }\n'
                + 'layer { name: "s" type: "Sigmoid" bottom: "aa" top: "aa" }\n')
    assert net.outputs == ['aa', 'zz']


def test_forward_returns_outputs_and_runs_partial_ranges():
    net = build(MLP)
    randomize(net)
    x = np.random.RandomState(1).standard_normal((2, 3, 2, 2)).astype(np.float32)
    out = net.forward(data=x)
    ref, _ = mlp_reference(net.params, x)
    assert set(out) == {'prob'}
    close(out['prob'], ref['prob'])
    out = net.forward(end='relu1')
    assert set(out) == {'ip1'}
    close(out['ip1'], ref['h'])
    net.blobs['ip1'].data[...] = 0
    out = net.forward(start='ip2', blobs=['ip2'])
    assert set(out) == {'prob', 'ip2'}
    close(out['ip2'], np.broadcast_to(net.params['ip2'][1].data, (2, 4)))
    with pytest.raises(CaffeError, match='nosuchblob'):
        net.forward(nosuchblob=x)
    with pytest.raises(CaffeError, match='nosuchlayer'):
        net.forward(start='nosuchlayer')


def test_backward_returns_input_diffs_and_accumulates_param_diffs():
    net = build('force_backward: true\n' + MLP)
    randomize(net)
    rs = np.random.RandomState(2)
    x = rs.standard_normal((2, 3, 2, 2)).astype(np.float32)
    dprob = rs.standard_normal((2, 4)).astype(np.float32)
    net.forward(data=x)
    net.clear_param_diffs()
    diffs = net.backward(prob=dprob)
    _, ref = mlp_reference(net.params, x, dprob)
    assert set(diffs) == {'data'}
    close(diffs['data'], ref['data'])
    close(net.blobs['ip1'].diff, ref['ip1'])          # in place: the grad of ip1's own output
    for key in ('ip1/0', 'ip1/1', 'ip2/0', 'ip2/1'):
        layer, index = key.split('/')
        close(net.params[layer][int(index)].diff, ref[key])
    net.backward(prob=dprob)                           # param diffs add up until cleared
    close(net.params['ip2'][0].diff, 2 * ref['ip2/0'])
    diffs = net.backward(end='ip2', diffs=['ip2'])
    assert set(diffs) == {'ip1', 'ip2'}
    close(diffs['ip1'], ref['ip1_out'])
    with pytest.raises(CaffeError, match='ip1'):
        net.backward(ip1=np.zeros((2, 5)))


def test_reshape_when_an_input_changes_shape():
    net = build(MLP)
    randomize(net)
    for batch in (2, 5, 1):
        x = np.random.RandomState(batch).standard_normal((batch, 3, 2, 2))
        out = net.forward(data=x)
        assert net.blobs['ip1'].shape == (batch, 5) and out['prob'].shape == (batch, 4)
        close(out['prob'], mlp_reference(net.params, x)[0]['prob'])
    net.blobs['data'].reshape(3, 3, 2, 2)
    net.reshape()
    assert net.blobs['ip2'].shape == (3, 4) and net.blobs['prob'].shape == (3, 4)
    with pytest.raises(CaffeError, match="'ip1'"):     # 27 inputs per item where 12 are learned
        net.forward(data=np.zeros((2, 3, 3, 3)))


def test_weight_files_round_trip(tmp_path):
    import h5py
    net = build(MLP, caffe.TEST)
    randomize(net)
    x = np.random.RandomState(3).standard_normal((2, 3, 2, 2))
    expected = net.forward(data=x)['prob'].copy()
    net.save(str(tmp_path / 'w.caffemodel'))
    net.save_hdf5(str(tmp_path / 'w.caffemodel.h5'))
    proto = caffe_pb2.NetParameter.FromString((tmp_path / 'w.caffemodel').read_bytes())
    assert [layer.name for layer in proto.layer] == list(net._layer_names)
    assert [list(b.shape.dim) for b in proto.layer[1].blobs] == [[5, 12], [5]]
    with h5py.File(tmp_path / 'w.caffemodel.h5', 'r') as f:
        assert f['data/ip2/0'].shape == (4, 5)
        np.testing.assert_array_equal(f['data/ip1/1'][()], net.params['ip1'][1].data)
    for load in ('copy_from', 'load_hdf5'):
        other = build(MLP, caffe.TEST)
        path = tmp_path / ('w.caffemodel' if load == 'copy_from' else 'w.caffemodel.h5')
        getattr(other, load)(str(path))
        for name, blobs in net.params.items():
            for a, b in zip(blobs, other.params[name]):
                np.testing.assert_array_equal(a.data, b.data)
        np.testing.assert_array_equal(other.forward(data=x)['prob'], expected)
    double = build(MLP, caffe.TEST, dtype=np.float64)
    double.copy_from(str(tmp_path / 'w.caffemodel'))
    double.save(str(tmp_path / 'w64.caffemodel'))       # float64 blobs go to double_data
    again = build(MLP, caffe.TEST, weights=str(tmp_path / 'w64.caffemodel'))
    np.testing.assert_array_equal(again.params['ip1'][0].data, net.params['ip1'][0].data)


# ---- NetState rules and legacy formats -----------------------------------------------------
RULES = ('state { stage: "s" }\n' + input_layer('data', 2, 3) + ''.join(
    'layer { name: "%s" type: "ReLU" bottom: "data" top: "%s" %s }\n' % (name, name, rules)
    for name, rules in [
        ('train_only', 'include { phase: TRAIN }'), ('test_only', 'include { phase: TEST }'),
        ('not_train', 'exclude { phase: TRAIN }'), ('level_ge2', 'include { min_level: 2 }'),
        ('level_le1', 'include { max_level: 1 }'), ('stage_ab', 'include { stage: "a" stage: "b" }'),
        ('a_or_test', 'include { stage: "a" } include { phase: TEST }'),
        ('not_b', 'include { not_stage: "b" }'), ('excl_a', 'exclude { stage: "a" }'),
        ('train_level1', 'include { phase: TRAIN min_level: 1 max_level: 1 }'),
        ('needs_s', 'include { stage: "s" }')]))


@pytest.mark.parametrize('phase, level, stages, expected', [
    (caffe.TRAIN, 0, [], 'train_only level_le1 not_b excl_a'),
    (caffe.TEST, 0, [], 'test_only not_train level_le1 a_or_test not_b excl_a'),
    (caffe.TRAIN, 2, ['a'], 'train_only level_ge2 a_or_test not_b'),
    (caffe.TEST, 1, ['a', 'b'], 'test_only not_train level_le1 stage_ab a_or_test'),
    (caffe.TRAIN, 1, ['b'], 'train_only level_le1 excl_a train_level1'),
])
def test_phase_level_and_stage_rules(phase, level, stages, expected):
    net = build(RULES, phase, level=level, stages=stages)
    names = [name for name, layer in zip(net._layer_names, net.layers) if layer.type != 'Split']
    assert names == ['data'] + expected.split() + ['needs_s']


def test_include_and_exclude_together_is_an_error():
    with pytest.raises(CaffeError, match="'both'"):
        build(input_layer('data', 2) + 'layer { name: "both" type: "ReLU" bottom: "data" top: "r" '
              'include { phase: TRAIN } exclude { phase: TEST } }')


V1_NET = '''name: "v1"
input: "data" input_dim: 2 input_dim: 3 input_dim: 1 input_dim: 2
input: "label" input_dim: 2 input_dim: 1 input_dim: 1 input_dim: 1
layers { name: "ip" type: INNER_PRODUCT bottom: "data" top: "ip" blobs_lr: 1 blobs_lr: 2
         weight_decay: 1 weight_decay: 0 inner_product_param { num_output: 4 } }
layers { name: "relu" type: RELU bottom: "ip" top: "ip" }
layers { name: "acc" type: ACCURACY bottom: "ip" bottom: "label" top: "acc" include { phase: TEST } }
layers { name: "loss" type: SOFTMAX_LOSS bottom: "ip" bottom: "label" top: "loss" }
'''
V2_NET = (input_layer('data', 2, 3, 1, 2) + input_layer('label', 2, 1, 1, 1)
          + ip_layer('ip', 'data', 'ip', 4, 'param { lr_mult: 1 decay_mult: 1 } '
                     'param { lr_mult: 2 decay_mult: 0 }')
          + 'layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }\n'
          + 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n')


def test_v1_layers_and_legacy_inputs_are_upgraded(tmp_path):
    path = tmp_path / 'v1.prototxt'
    path.write_text(V1_NET)
    net = caffe.Net(str(path), caffe.TRAIN)
    assert list(net._layer_names) == ['input', 'ip', 'relu', 'loss']
    assert [layer.type for layer in net.layers] == ['Input', 'InnerProduct', 'ReLU', 'SoftmaxWithLoss']
    assert net.inputs == ['data', 'label'] and net.blobs['label'].shape == (2, 1, 1, 1)
    assert net.params_lr == [1, 2] and net.params_weight_decay == [1, 0]
    assert 'acc' in caffe.Net(str(path), caffe.TEST)._layer_names
    randomize(net)
    net.save(str(tmp_path / 'v1.caffemodel'))
    modern = build(V2_NET, weights=str(tmp_path / 'v1.caffemodel'))
    x, label = np.random.RandomState(4).standard_normal((2, 3, 1, 2)), np.array([1, 3]).reshape(2, 1, 1, 1)
    expected = net.forward(data=x, label=label)['loss']
    close(modern.forward(data=x, label=label)['loss'], expected)
    assert modern.params_lr == net.params_lr and modern.params_weight_decay == net.params_weight_decay


def test_legacy_input_shape_field():
    net = build('input: "a" input_shape { dim: 2 dim: 6 } input: "b" input_shape { dim: 3 }\n'
                'layer { name: "r" type: "ReLU" bottom: "a" top: "r" }')
    assert net.inputs == ['a', 'b'] and net.blobs['a'].shape == (2, 6) and net.blobs['b'].shape == (3,)
    assert net.layers[0].type == 'Input'


# ---- in-place and Split layers -------------------------------------------------------------
def test_chain_of_in_place_layers():
    net = build('force_backward: true\n' + input_layer('x', 2, 3)
                + 'layer { name: "relu" type: "ReLU" bottom: "x" top: "y" }\n'
                + 'layer { name: "double" type: "Power" bottom: "y" top: "y" power_param { scale: 2 } }\n'
                + 'layer { name: "tanh" type: "TanH" bottom: "y" top: "y" }\n')
    assert list(net.blobs) == ['x', 'y']
    x = np.random.RandomState(5).standard_normal((2, 3))
    y = np.tanh(2 * np.maximum(x, 0))
    close(net.forward(x=x)['y'], y)
    dy = np.random.RandomState(6).standard_normal((2, 3))
    dx = net.backward(y=dy)['x']
    # the blob's diff ends as the gradient w.r.t. the output of the layer that created it
    close(net.blobs['y'].diff, dy * (1 - y ** 2) * 2)
    close(dx, dy * (1 - y ** 2) * 2 * (x > 0))


SPLIT_NET = '''force_backward: true
layer { name: "input" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } } }
layer { name: "relu" type: "ReLU" bottom: "x" top: "r" }
layer { name: "sig" type: "Sigmoid" bottom: "r" top: "a" }
layer { name: "tanh" type: "TanH" bottom: "r" top: "b" }
layer { name: "scale" type: "Power" bottom: "x" top: "c" power_param { scale: 2.0 } }
'''     # the golden case split_implicit


def test_split_insertion_names_and_diff_accumulation(monkeypatch):
    net = build(SPLIT_NET)
    names = ['x', 'x_input_0_split_0', 'x_input_0_split_1', 'r', 'r_relu_0_split_0',
             'r_relu_0_split_1', 'a', 'b', 'c']
    assert list(net.blobs) == names
    golden = GOLDEN / 'split_implicit.npz'
    if golden.exists():                               # Caffe's own key names
        assert sorted(k[5:] for k in np.load(golden).files if k.startswith('data/')) == sorted(names)
    assert list(net._layer_names) == ['input', 'x_input_0_split', 'relu', 'r_relu_0_split', 'sig',
                                      'tanh', 'scale']
    assert net.layers[1].type == 'Split' and net.top_names['r_relu_0_split'] == names[4:6]
    assert net.bottom_names['scale'] == ['x_input_0_split_1']
    rs = np.random.RandomState(7)
    x = rs.standard_normal((2, 3, 4, 4))
    da, db, dc = (rs.standard_normal((2, 3, 4, 4)) for _ in range(3))
    net.forward(x=x)
    diffs = net.backward(a=da, b=db, c=dc)
    r = np.maximum(x, 0)
    sig, tanh = 1 / (1 + np.exp(-r)), np.tanh(r)
    close(net.blobs['r_relu_0_split_0'].diff, da * sig * (1 - sig))
    close(net.blobs['r_relu_0_split_1'].diff, db * (1 - tanh ** 2))
    dr = da * sig * (1 - sig) + db * (1 - tanh ** 2)
    close(net.blobs['r'].diff, dr)
    close(diffs['x'], dr * (x > 0) + 2 * dc)
    if golden.exists():
        ref = np.load(golden)
        net.forward(x=ref['input/x'])
        net.backward(**{k: ref['topdiff/' + k] for k in 'abc'})
        for key in ref.files:
            if key.startswith(('data/', 'diff/')):
                kind, name = key.split('/')
                close(getattr(net.blobs[name], kind), ref[key])


def test_a_loss_layer_without_a_top_gets_one_and_its_loss_counts():
    """Caffe's AutoTopBlobs, which DeepLab's training nets rely on: its SoftmaxWithLoss
    layers name no top. The loss counts with weight 1 and reaches the scores' diff."""
    text = 'force_backward: true\n' + input_layer('x', 2, 3) + input_layer('y', 2) + \
        'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "x" bottom: "y" }\n' + \
        'layer { name: "again" type: "SoftmaxWithLoss" bottom: "x" bottom: "y" top: "loss" }\n'
    net = build(text, dtype=np.float64)
    x = np.array([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
    y = np.array([2.0, 0.0])
    out = net.forward(x=x, y=y)
    expected = -np.mean(np.log(np.exp(x) / np.exp(x).sum(axis=1, keepdims=True))[[0, 1], [2, 0]])
    assert set(out) == {'loss', 'loss (automatic)'}
    assert float(out['loss (automatic)']) == pytest.approx(expected)
    net.backward()
    softmax = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    close(net.blobs['x'].diff, 2 * (softmax - np.eye(3)[[2, 0]]) / 2)


def test_one_layer_consuming_a_blob_twice():
    net = build('force_backward: true\n' + input_layer('x', 2, 3)
                + 'layer { name: "sum" type: "Eltwise" bottom: "x" bottom: "x" top: "y" }\n')
    assert net.bottom_names['sum'] == ['x_x_0_split_0', 'x_x_0_split_1']
    x, dy = np.arange(6.).reshape(2, 3), np.linspace(-1, 1, 6).reshape(2, 3)
    close(net.forward(x=x)['y'], 2 * x)
    close(net.backward(y=dy)['x'], 2 * dy)


def test_repeated_layer_names_are_accepted():
    """BVLC's mnist_autoencoder has two layers named 'loss'; Caffe builds it."""
    net = build(input_layer('x', 2, 3) + input_layer('t', 2, 3)
                + 'layer { name: "loss" type: "EuclideanLoss" bottom: "x" bottom: "t" top: "l1" }\n'
                + 'layer { name: "loss" type: "EuclideanLoss" bottom: "x" bottom: "t" top: "l2" '
                  'loss_weight: 0 }\n')
    assert list(net._layer_names).count('loss') == 2 and net.outputs == ['l1', 'l2']


def test_set_random_seed_repeats_filler_draws():
    text = input_layer('x', 2, 3) + ip_layer('ip', 'x', 'y', 4).replace(
        'num_output: 4', 'num_output: 4 weight_filler { type: "gaussian" std: 1 }')
    caffe.set_mode_cpu()
    caffe.set_random_seed(1701)
    first = build(text).params['ip'][0].data.copy()
    caffe.set_random_seed(1701)
    np.testing.assert_array_equal(build(text).params['ip'][0].data, first)
    assert np.std(first) > 0.3


# ---- Python layers and NetSpec ---------------------------------------------------------------
def test_python_layer_from_sys_path(pylayers):
    net = build('force_backward: true\n' + input_layer('x', 2, 3)
                + python_layer('mul', 'x', 'y', param_str=json.dumps({'factor': 2.5})))
    layer = net.layers[1]
    assert isinstance(layer, pylayers.Multiply) and layer.param_str == '{"factor": 2.5}'
    x = np.random.RandomState(14).standard_normal((2, 3))
    close(net.forward(x=x)['y'], 2.5 * x)
    close(net.backward(y=np.ones((2, 3)))['x'], np.full((2, 3), 2.5))
    with pytest.raises(CaffeError, match="'mul'.*no_such_module"):
        build(input_layer('x', 2) + python_layer('mul', 'x', 'y').replace('pylayer_examples',
                                                                          'no_such_module'))
    with pytest.raises(CaffeError, match="'mul'.*NoSuchClass"):
        build(input_layer('x', 2) + python_layer('mul', 'x', 'y', layer='NoSuchClass'))


def test_netspec_builds_a_working_net(tmp_path):
    n = NetSpec()
    n.data, n.label = L.Input(shape=[dict(dim=[2, 1, 6, 6]), dict(dim=[2])], ntop=2)
    n.conv1 = L.Convolution(n.data, num_output=3, kernel_size=3, pad=1,
                            weight_filler=dict(type='xavier'),
                            param=[dict(lr_mult=1), dict(lr_mult=2, decay_mult=0)])
    n.relu1 = L.ReLU(n.conv1, in_place=True)
    n.pool1 = L.Pooling(n.relu1, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.ip1 = L.InnerProduct(n.pool1, num_output=5, weight_filler=dict(type='gaussian', std=0.1))
    n.loss = L.SoftmaxWithLoss(n.ip1, n.label)
    n.acc = L.Accuracy(n.ip1, n.label, include=dict(phase=caffe.TEST))
    path = tmp_path / 'spec.prototxt'
    path.write_text(str(n.to_proto()))
    parsed = text_format.Parse(path.read_text(), caffe_pb2.NetParameter())
    assert parsed.layer[3].pooling_param.pool == caffe_pb2.PoolingParameter.MAX
    assert list(parsed.layer[0].top) == ['data', 'label']
    net = caffe.Net(str(path), caffe.TRAIN)
    assert list(net._layer_names) == ['data', 'conv1', 'relu1', 'pool1', 'ip1', 'loss']
    assert net.top_names['relu1'] == ['conv1'] and net.blobs['pool1'].shape == (2, 3, 3, 3)
    assert net.params_lr == [1, 2, 1, 1] and net.params_weight_decay == [1, 0, 1, 1]
    out = net.forward(data=np.ones((2, 1, 6, 6)), label=np.array([0, 4]))
    assert np.isfinite(out['loss'])
    assert 'acc' in caffe.Net(str(path), caffe.TEST)._layer_names
    auto = to_proto(L.ReLU(L.Input(shape=dict(dim=[1, 2]))))
    assert [(layer.name, list(layer.top)) for layer in auto.layer] == [('Input1', ['Input1']),
                                                                       ('ReLU1', ['ReLU1'])]
