"""ONNX export (caffe_syncbn.export.to_onnx), run by onnxruntime and compared with:
real Caffe's recorded outputs (the golden cases), our Net's forward on the corpus deploy
nets with random weights, and our forward on small nets for what the golden cases miss
(tests/test_onnx_rules.py)."""
import json

import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.convert import to_syncbn
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.io.caffemodel import layer_blobs, read_net_param
from caffe_syncbn.layer import LayerContext
from caffe_syncbn.net import load_net_param
from conftest import CORPUS, GOLDEN, require
from onnx_helpers import assert_close, highest_common_opset, input_layer, parse, run

pytest.importorskip('onnx', reason="ONNX export needs onnx: pip install '.[onnx]'")
pytest.importorskip('onnxruntime', reason='the ONNX tests run models with onnxruntime: '
                                          'pip install onnxruntime')
from caffe_syncbn.export import to_onnx  # noqa: E402  (after the skips)
from caffe_syncbn.export.graph import exportable_types  # noqa: E402

RESNET = 'KaimingHe_deep-residual-networks__prototxt_ResNet-50-deploy.prototxt'
ALEXNET = 'BVLC_caffe__models_bvlc_alexnet_deploy.prototxt'
CAFFENET = 'BVLC_caffe__models_bvlc_reference_caffenet_deploy.prototxt'
FCN8S = 'shelhamer_fcn.berkeleyvision.org__voc-fcn8s_deploy.prototxt'
PSPNET = 'hszhao_PSPNet__evaluation_prototxt_pspnet50_ADE20K_473.prototxt'
OPSETS = sorted({17, highest_common_opset()})


# ---- 1. the golden cases: real Caffe's outputs ------------------------------------------------
# Pooling and Interp edge cases the selection below must keep.
REQUIRED_GOLDEN = {'pool_max_ceil', 'pool_ave_ceil', 'pool_max_pad_clip', 'pool_ave_pad_clip',
                   'pool_max_stride_gt_kernel', 'pool_ave_pad1', 'pool_max_topmask',
                   'pool_max_floor', 'spp_max_h3', 'spp_ave_h2', 'lrn_within',
                   'psp_interp_zoom', 'psp_interp_zoom8', 'psp_interp_shrink', 'psp_interp_hw',
                   'psp_interp_hw_edge', 'psp_interp_pad_zoom', 'psp_interp_pad_hw',
                   'psp_interp_pad_same_size', 'psp_interp_hw_and_zoom', 'psp_deploy_tail_test',
                   'format_v1_caffemodel'}


def _same_forward_in_test_phase(param):
    """Whether a TRAIN case's forward is the TEST-phase graph we export: no batch statistics,
    no dropout, no random pooling, no phase rules."""
    for lp in param.layer:
        if lp.include or lp.exclude or lp.type == 'Dropout':
            return False
        if lp.type == 'BatchNorm' and not lp.batch_norm_param.use_global_stats:
            return False
        if lp.type in ('BN', 'SyncBN') and not lp.bn_param.frozen:
            return False
        if lp.type == 'Pooling' and lp.pooling_param.pool == caffe_pb2.PoolingParameter.STOCHASTIC:
            return False
    return True


def golden_cases():
    """Names of the golden cases whose layers all export and whose forward is TEST's."""
    if not (GOLDEN / 'index.json').exists():
        return ['<no golden data>']
    exportable = set(exportable_types())
    names = []
    for index in ('index.json', 'psp_index.json'):
        path = GOLDEN / index
        for case in json.loads(path.read_text())['cases'] if path.exists() else []:
            prototxt = GOLDEN / (case['name'] + '.prototxt')
            if case['kind'] == 'solver' or not prototxt.exists():
                continue
            param = parse(prototxt.read_text())
            if {lp.type for lp in param.layer} <= exportable and (
                    case['phase'] == 'TEST' or _same_forward_in_test_phase(param)):
                names.append(case['name'])
    return names


GOLDEN_CASES = golden_cases()


def test_golden_selection_keeps_the_edge_cases():
    require(GOLDEN / 'index.json')
    assert REQUIRED_GOLDEN <= set(GOLDEN_CASES), sorted(REQUIRED_GOLDEN - set(GOLDEN_CASES))


def golden_weights(name):
    """The case's weights as {layer: arrays}; the V1 caffemodel where there is one."""
    for suffix in ('.v1.caffemodel', '.caffemodel'):
        path = GOLDEN / (name + suffix)
        if path.exists():
            return layer_blobs(read_net_param(path))
    return None


@pytest.mark.parametrize('opset', OPSETS)
@pytest.mark.parametrize('name', GOLDEN_CASES)
def test_golden_case_matches_caffe(name, opset):
    require(GOLDEN / (name + '.npz'))
    reference = np.load(GOLDEN / (name + '.npz'))
    model = to_onnx(GOLDEN / (name + '.prototxt'), golden_weights(name), opset=opset)
    feeds = {i.name: reference['input/' + i.name] for i in model.graph.input}
    outputs = run(model, feeds)
    assert outputs
    for blob, value in outputs.items():
        assert_close(value, reference['data/' + blob], '%s: %s' % (name, blob))


# ---- 2. the corpus deploy nets, with random weights --------------------------------------------
def fan_in(layer):
    shape = layer.blobs[0].shape
    if layer.type == 'InnerProduct':
        return layer.inputs
    if layer.type == 'Deconvolution':     # each output sees C_in/group * (k/stride)^d inputs
        return shape[0] // layer.group * np.prod(layer.kernel) / np.prod(layer.stride)
    return np.prod(shape[1:])


BATCH_NORMS = ('BatchNorm', 'BN', 'SyncBN')


def random_weights(net, rng):
    """Fan-in scaled weights, small biases, Scale gammas near 1; written
    into ``net`` and returned as {layer: arrays}. Batch norms are left to calibrate()."""
    weights = {}
    for name, layer in zip(net._layer_names, net.layers):
        shapes = [b.shape for b in layer.blobs]
        if not shapes or layer.type in BATCH_NORMS:
            continue
        if layer.type == 'Scale':
            values = [rng.uniform(0.8, 1.2, shapes[0])] + \
                [rng.normal(0, 0.1, s) for s in shapes[1:]]
        else:
            # uniform with He's variance 2 / fan-in (uniform draws are the cheaper ones)
            bound = np.float32(np.sqrt(6.0 / fan_in(layer)))
            weight = rng.random(shapes[0], np.float32)
            weight -= np.float32(0.5)
            weight *= 2 * bound
            values = [weight] + [rng.normal(0, 0.05, s) for s in shapes[1:]]
        weights[name] = [np.asarray(v, np.float32) for v in values]
        for blob, value in zip(layer.blobs, weights[name]):
            blob.data[...] = value
    return weights


def calibrate(net, weights, rng):
    """Run ``net`` layer by layer, giving each batch norm statistics from its actual input,
    so that 100+ of them keep activations in range, yet unlike them: variances scaled by
    0.8..1.25 (plus a floor), BatchNorm scale factors in 0.5..2 (not 1), and means that
    remove only up to a tenth of the input's mean, plus 0.2 std of noise. Removing all of
    it would cancel the large positive mean that ReLU leaves at every layer, and that
    cancellation amplifies float32 rounding (about 1.2x per layer): after PSPNet's 100
    layers two float32 implementations would differ by 1e-4, ours from float64 too.
    Returns the net's outputs."""
    for i, (name, layer) in enumerate(zip(net._layer_names, net.layers)):
        if layer.type in BATCH_NORMS:
            x = np.asarray(net.blobs[net.bottom_names[name][0]].data)
            axes = (0,) + tuple(range(2, x.ndim))
            mean, var = x.mean(axis=axes), x.var(axis=axes)
            std = np.sqrt(var)
            mean = mean * rng.uniform(0, 0.1, mean.shape) + std * rng.normal(0, 0.2, mean.shape)
            # the floor: one value per channel (PSPNet's 1x1 pyramid bin) has no variance
            var = var * rng.uniform(0.8, 1.25, var.shape) + 0.1 * np.mean(x * x)
            if layer.type == 'BatchNorm':       # mean sum, variance sum, scale factor
                s = rng.uniform(0.5, 2.0)
                values = [s * mean, s * var, [s]]
            else:                               # slope, bias, running mean, running var
                values = [rng.uniform(0.8, 1.2, mean.shape), rng.normal(0, 0.1, mean.shape),
                          mean, var]
            weights[name] = [np.asarray(v, np.float32).reshape(b.shape)
                             for v, b in zip(values, layer.blobs)]
            for blob, value in zip(layer.blobs, weights[name]):
                blob.data[...] = value
        net.forward_prefilled(i, i)
    return {k: np.array(net.blobs[k].data) for k in net.outputs}


class Deployed:
    """A corpus deploy net with random weights, an input and our forward (the reference).

    ``input_shape`` replaces the prototxt's input shape, here and in ``export()`` (through
    to_onnx's input_shapes)."""

    def __init__(self, name, input_shape=None, seed=0):
        require(CORPUS / name)
        self.param = load_net_param(CORPUS / name)
        built = caffe_pb2.NetParameter()
        built.CopyFrom(self.param)
        source = next(lp for lp in built.layer if lp.type == 'Input')
        self.input = source.top[0]
        self.input_shapes = None
        if input_shape is not None:
            self.input_shapes = {self.input: input_shape}
            del source.input_param.shape[0].dim[:]
            source.input_param.shape[0].dim.extend(input_shape)
        net = caffe.Net(built, caffe.TEST, context=LayerContext(phase=caffe.TEST))
        rng = np.random.default_rng(seed)
        self.weights = random_weights(net, rng)
        self.x = rng.uniform(-1, 1, net.blobs[self.input].shape).astype(np.float32)
        net.blobs[self.input].data[...] = self.x
        self.expected = calibrate(net, self.weights, rng)
        self.net = net

    def export(self, **kwargs):
        return to_onnx(self.param, self.weights, input_shapes=self.input_shapes, **kwargs)

    def check(self, model):
        outputs = run(model, {self.input: self.x})
        assert sorted(outputs) == sorted(self.expected)
        for blob, value in outputs.items():
            expected = self.expected[blob]
            assert np.ptp(expected) > 1e-6 * np.abs(expected).max() > 0, \
                '%s is constant: random weights too large or too small' % blob
            assert_close(value, expected, blob)


@pytest.fixture(scope='module')
def resnet():
    return Deployed(RESNET)


def test_resnet50_exports(resnet):
    model = resnet.export()
    assert [i.name for i in model.graph.input] == ['data']
    assert [o.name for o in model.graph.output] == ['prob']
    layer_names = set(resnet.net._layer_names)
    assert all(node.name.split('/')[0] in layer_names for node in model.graph.node)
    assert sum(node.op_type == 'BatchNormalization' for node in model.graph.node) == 53
    # the logits are spread out, so the softmax does not hide errors
    assert 1 < np.ptp(resnet.net.blobs['fc1000'].data) < 100
    resnet.check(model)


def test_resnet50_as_syncbn_exports(resnet):
    param, weights = to_syncbn(resnet.param, resnet.weights)
    assert sum(lp.type == 'SyncBN' for lp in param.layer) == 53
    net = caffe.Net(param, caffe.TEST)
    for name, arrays in weights.items():
        for blob, array in zip(net.params[name], arrays):
            blob.data[...] = array
    expected = net.forward(data=resnet.x)['prob']
    assert_close(run(to_onnx(param, weights), {'data': resnet.x})['prob'], expected, 'prob')


def test_resnet50_dynamic_batch(resnet):
    model = resnet.export(dynamic_batch=True)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == 'batch'
    assert model.graph.output[0].type.tensor_type.shape.dim[0].dim_param == 'batch'
    x = np.random.default_rng(5).uniform(-1, 1, (3, 3, 224, 224)).astype(np.float32)
    expected = resnet.net.forward(data=x)['prob']
    assert_close(run(model, {'data': x})['prob'], expected, 'prob at batch 3')


@pytest.mark.parametrize('name', [ALEXNET, CAFFENET])
def test_alexnet_family_exports(name):
    deployed = Deployed(name, input_shape=(2, 3, 227, 227))     # the prototxt's batch is 10
    deployed.check(deployed.export())


@pytest.mark.slow
def test_fcn8s_exports():
    # FCN-8s takes any input size; 500x500 would cost 4x the time for the same layers
    deployed = Deployed(FCN8S, input_shape=(1, 3, 256, 256))
    deployed.check(deployed.export())


@pytest.mark.slow
def test_pspnet50_exports():
    deployed = Deployed(PSPNET)
    model = deployed.export()
    assert sum(node.op_type == 'Resize' for node in model.graph.node) == 5
    deployed.check(model)


# ---- 3. what to_onnx refuses ---------------------------------------------------------------
def net_text(body, shape=(2, 3, 8, 8)):
    return 'name: "t"\n' + input_layer('data', *shape) + body


def test_unsupported_layers_are_all_named_in_one_error():
    text = net_text('''
        layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 2 } } }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
                inner_product_param { num_output: 4 } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
        layer { name: "lstm" type: "LSTM" bottom: "ip" bottom: "label" top: "h"
                recurrent_param { num_output: 3 } }
        layer { name: "py" type: "Python" bottom: "ip" top: "py"
                python_param { module: "nowhere" layer: "Nothing" } }
        layer { name: "hinge" type: "HingeLoss" bottom: "ip" bottom: "label" top: "hinge" }
    ''')
    with pytest.raises(CaffeError) as error:
        to_onnx(parse(text))
    message = str(error.value)
    assert '\n' not in message and '4 layer(s)' in message
    for name, kind in (('loss', 'SoftmaxWithLoss'), ('lstm', 'LSTM'), ('py', 'Python'),
                       ('hinge', 'HingeLoss')):
        assert "'%s' (%s)" % (name, kind) in message
    assert "'ip'" not in message


def test_configurations_without_onnx_form_are_all_named():
    # a MAX window wholly outside the input (stride 4 past a 6-wide input), random DummyData
    text = net_text('''
        layer { name: "far" type: "Pooling" bottom: "data" top: "far"
                pooling_param { pool: MAX kernel_size: 1 stride: 4 } }
        layer { name: "noise" type: "DummyData" top: "noise"
                dummy_data_param { shape { dim: 2 } data_filler { type: "gaussian" } } }
        layer { name: "fine" type: "ReLU" bottom: "far" top: "fine" }
    ''', shape=(1, 1, 6, 6))
    with pytest.raises(CaffeError, match=r"2 layer\(s\).*'far' \(Pooling\): its last MAX window"
                                         r".*'noise' \(DummyData\): random fillers"):
        to_onnx(parse(text))


def test_bad_arguments_are_one_line_errors():
    text = net_text('layer { name: "r" type: "ReLU" bottom: "data" top: "r" }')
    with pytest.raises(CaffeError, match='opset 16 is not supported'):
        to_onnx(parse(text), opset=16)
    with pytest.raises(CaffeError, match="input_shapes names image, which is not an Input blob"):
        to_onnx(parse(text), input_shapes={'image': (1, 3, 4, 4)})
    conv = net_text('layer { name: "c" type: "Convolution" bottom: "data" top: "c" '
                    'convolution_param { num_output: 2 kernel_size: 3 } }')
    with pytest.raises(CaffeError, match=r"layer 'c': blob 0 has shape \[2, 3, 2, 2\] but the "
                                         r"net's has shape \[2, 3, 3, 3\]"):
        to_onnx(parse(conv), {'c': [np.zeros((2, 3, 2, 2)), np.zeros(2)]})
    with pytest.raises(CaffeError, match="layer 'c': 1 blob"):
        to_onnx(parse(conv), {'c': [np.zeros((2, 3, 3, 3))]})


def test_dynamic_batch_refuses_a_net_tied_to_its_batch():
    text = net_text('layer { name: "fold" type: "Reshape" bottom: "data" top: "fold" '
                    'reshape_param { shape { dim: 6 dim: -1 } } }')
    with pytest.raises(CaffeError, match="dynamic batch: layer 'fold' \\(type Reshape\\) gives "
                                         "blob 'fold' the shape \\[6, 64\\]"):
        to_onnx(parse(text), dynamic_batch=True)
    # without a dynamic batch it exports
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    assert_close(run(to_onnx(parse(text)), {'data': x})['fold'], x.reshape(6, 64), 'fold')
    halves = net_text('layer { name: "halves" type: "Slice" bottom: "data" top: "a" top: "b" '
                      'slice_param { axis: 0 } }')
    with pytest.raises(CaffeError, match="'halves' \\(Slice\\): slicing along axis 0 cannot "
                                         "have a symbolic batch"):
        to_onnx(parse(halves), dynamic_batch=True)
