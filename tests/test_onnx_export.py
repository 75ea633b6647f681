"""ONNX export (caffe_syncbn.export.to_onnx), run by onnxruntime and compared with:
real Caffe's recorded outputs (the golden cases), our Net's forward on the corpus deploy
nets with random weights, and our forward on small nets for what the golden cases miss
(tests/test_onnx_rules.py)."""
import json

import numpy as np
import pytest
from helpers.model_weights import Deployed
from helpers.onnx_helpers import assert_close, highest_common_opset, input_layer, parse, run

from caffe_syncbn import caffe_pb2
from caffe_syncbn.convert import to_syncbn
from caffe_syncbn.errors import CaffeError

from helpers.paths import GOLDEN, require

pytest.importorskip('onnx', reason="ONNX export needs onnx: pip install '.[onnx]'")
pytest.importorskip('onnxruntime', reason='the ONNX tests run models with onnxruntime: '
                                          'pip install onnxruntime')
from caffe_syncbn.export import to_onnx  # noqa: E402  (after the skips)
from caffe_syncbn.export.model import exportable_types  # noqa: E402

RESNET = 'KaimingHe_deep-residual-networks__prototxt_ResNet-50-deploy.prototxt'
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
    """The case's caffemodel; the V1 one where there is one."""
    for suffix in ('.v1.caffemodel', '.caffemodel'):
        path = GOLDEN / (name + suffix)
        if path.exists():
            return str(path)
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


# ---- 2. ResNet-50 (test_corpus_exports.py runs every corpus deploy net) ------------------
@pytest.fixture(scope='module')
def resnet():
    return Deployed(RESNET)


def test_resnet50_exports(resnet):
    model = to_onnx(resnet.param, resnet.weights)
    assert [i.name for i in model.graph.input] == ['data']
    assert [o.name for o in model.graph.output] == ['prob']
    layer_names = set(resnet.net._layer_names)
    assert all(node.name.split('/')[0] in layer_names for node in model.graph.node)
    assert sum(node.op_type == 'BatchNormalization' for node in model.graph.node) == 53
    # the logits are spread out, so the softmax does not hide errors
    assert 1 < np.ptp(resnet.net.blobs['fc1000'].data) < 100
    resnet.check(run(model, {'data': resnet.x}), 'to-onnx')


def test_resnet50_as_syncbn_exports(resnet):
    param, weights = to_syncbn(resnet.param, resnet.weights)
    assert sum(lp.type == 'SyncBN' for lp in param.layer) == 53
    expected = resnet.forward(param, weights)['prob']
    assert_close(run(to_onnx(param, weights), {'data': resnet.x})['prob'], expected, 'prob')


def test_resnet50_dynamic_batch(resnet):
    model = to_onnx(resnet.param, resnet.weights, dynamic_batch=True)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == 'batch'
    assert model.graph.output[0].type.tensor_type.shape.dim[0].dim_param == 'batch'
    x = np.random.default_rng(5).uniform(-1, 1, (3, 3, 224, 224)).astype(np.float32)
    expected = resnet.net.forward(data=x)['prob']
    assert_close(run(model, {'data': x})['prob'], expected, 'prob at batch 3')


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
    with pytest.raises(CaffeError, match=r"layer 'c' blob 0 has shape \[2, 3, 2, 2\] in the "
                                         r"weights but \[2, 3, 3, 3\] in the net: the weights "
                                         r"are for another net$"):
        to_onnx(parse(conv), {'c': [np.zeros((2, 3, 2, 2)), np.zeros(2)]})
    with pytest.raises(CaffeError, match=r"layer 'c' has 1 blob\(s\) in the file but 2"):
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
