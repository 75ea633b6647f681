"""Neuron, shape, element-wise, Scale/Bias, Softmax and MVN layers: Caffe's golden
outputs, finite-difference gradients, in-place runs and Caffe's corner cases."""
import json

import numpy as np
import pytest
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2
from caffe_syncbn.blob import Blob
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.fillers import set_random_seed
from caffe_syncbn.layer import TEST, TRAIN
from caffe_syncbn.testing import build_layer, check_gradient, layer_param

from conftest import GOLDEN, require

MY_TYPES = {
    'ReLU', 'PReLU', 'ELU', 'Sigmoid', 'TanH', 'AbsVal', 'BNLL', 'Power', 'Exp', 'Log',
    'Threshold', 'Clip', 'Swish', 'Dropout', 'Split', 'Concat', 'Slice', 'Flatten', 'Reshape',
    'Tile', 'Crop', 'Silence', 'BatchReindex', 'Filter', 'Parameter', 'ArgMax', 'Reduction',
    'Eltwise', 'Scale', 'Bias', 'Softmax', 'MVN'}


# ---------------------------------------------------------------- golden cases

def _golden_index():
    if not (GOLDEN / 'index.json').exists():
        return {}
    return {c['name']: c for c in json.loads((GOLDEN / 'index.json').read_text())['cases']}


def _net_param(case):
    return text_format.Parse((GOLDEN / ('%s.prototxt' % case)).read_text(),
                             caffe_pb2.NetParameter())


def _golden_layers():
    """(case, layer name) for every layer of ours in a layer or net case."""
    pairs = []
    for name, case in sorted(_golden_index().items()):
        if case['kind'] not in ('layer', 'net') or not MY_TYPES & set(case['layer_types']):
            continue
        pairs += [(name, lp.name) for lp in _net_param(name).layer if lp.type in MY_TYPES]
    return pairs or [('<no golden data>', None)]


def _close(actual, expected, what):
    np.testing.assert_allclose(np.asarray(actual).reshape(np.shape(expected)), expected,
                               rtol=1e-4, atol=1e-5, err_msg=what)


def _blob_needs_backward(net, upto, npz):
    """Caffe's need-backward flags of the blobs just before layer ``upto`` runs."""
    need = {}
    for lp in net.layer:
        if lp.name == upto:
            return need
        count = sum(1 for k in npz.files if k.startswith('param_after/%s/' % lp.name))
        lr = [lp.param[j].lr_mult if j < len(lp.param) else 1.0 for j in range(count)]
        learns = lp.type != 'BatchNorm' and any(m != 0 for m in lr)
        layer_needs = learns or any(need.get(b, False) for b in lp.bottom)
        for t in lp.top:
            need[t] = layer_needs
    raise KeyError(upto)


def run_golden_layer(case_name, layer_name):
    """Run one layer of a golden case on the recorded blobs and compare its outputs,
    bottom diffs and param diffs with Caffe's. Blobs rewritten by an in-place layer
    (whose recorded value is the last writer's) and blobs with several consumers (whose
    recorded diff is a sum) are left out of the comparison."""
    require(GOLDEN / 'index.json')
    case = _golden_index()[case_name]
    net = _net_param(case_name)
    lp = next(layer for layer in net.layer if layer.name == layer_name)
    npz = np.load(GOLDEN / ('%s.npz' % case_name))
    written_in_place = {t for layer in net.layer for t in layer.top if t in layer.bottom}
    if written_in_place & (set(lp.top) | set(lp.bottom)):
        pytest.skip('%s runs on in-place blobs; the whole-net runner checks it' % layer_name)
    phase = TRAIN if str(npz['phase']) == 'TRAIN' else TEST

    layer, bottom, top = build_layer(lp, [npz['data/' + b] for b in lp.bottom],
                                     phase=phase, dtype=np.float32)
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = npz['param_after/%s/%d' % (layer_name, i)]
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    for name, t in zip(lp.top, top):
        _close(t.data, npz['data/' + name], '%s: top %s' % (case_name, name))
    if not case['backward']:
        return

    need = _blob_needs_backward(net, layer_name, npz)
    propagate_down = [need.get(b, False) or (net.force_backward and layer.allow_force_backward(i))
                      for i, b in enumerate(lp.bottom)]
    for name, t in zip(lp.top, top):
        t.diff[...] = npz['diff/' + name].reshape(t.shape)
    lr = [lp.param[j].lr_mult if j < len(lp.param) else 1.0 for j in range(len(layer.blobs))]
    layer.param_propagate_down = [m != 0 for m in lr]
    for blob in layer.blobs:
        blob.diff[...] = 0
    layer.backward(top, propagate_down, bottom)
    consumers = [b for layer in net.layer for b in layer.bottom]
    for name, b, down in zip(lp.bottom, bottom, propagate_down):
        if down and consumers.count(name) == 1:
            _close(b.diff, npz['diff/' + name], '%s: diff of bottom %s' % (case_name, name))
    for i, blob in enumerate(layer.blobs):
        if layer.param_propagate_down[i]:
            _close(blob.diff, npz['param_diff/%s/%d' % (layer_name, i)],
                   '%s: param diff %s/%d' % (case_name, layer_name, i))


@pytest.mark.parametrize('case_name, layer_name', _golden_layers())
def test_golden(case_name, layer_name):
    run_golden_layer(case_name, layer_name)


# ---------------------------------------------------------------- gradient checks

RS = np.random.RandomState(7)


def away_from_zero(*shape, low=0.1):
    """Random values with |x| >= low, so no element sits on a kink."""
    return RS.uniform(low, 1.0, shape) * RS.choice([-1.0, 1.0], shape)


def positive(*shape, low=0.2, high=2.0):
    return RS.uniform(low, high, shape)


NEURON_GRADIENTS = [
    ("type: 'ReLU'", away_from_zero(2, 3, 3)),
    ("type: 'ReLU' relu_param { negative_slope: 0.1 }", away_from_zero(2, 3, 3)),
    ("type: 'ELU' elu_param { alpha: 0.7 }", away_from_zero(2, 3, 3)),
    ("type: 'Sigmoid'", RS.randn(2, 3, 3) * 2),
    ("type: 'TanH'", RS.randn(2, 3, 3)),
    ("type: 'AbsVal'", away_from_zero(2, 3, 3)),
    ("type: 'BNLL'", RS.randn(2, 3, 3) * 3),
    ("type: 'Power' power_param { power: 3 scale: 0.8 shift: 0.2 }", RS.randn(2, 3, 3)),
    ("type: 'Power' power_param { power: 0.5 scale: 1.5 shift: 2 }", positive(2, 3, 3)),
    ("type: 'Power' power_param { power: 2 }", RS.randn(2, 3, 3)),
    ("type: 'Power' power_param { power: 1 scale: -0.5 shift: 1 }", RS.randn(2, 3, 3)),
    ("type: 'Power' power_param { power: 0 scale: 2 }", RS.randn(2, 3)),
    ("type: 'Exp' exp_param { base: 2 scale: 0.5 shift: 0.1 }", RS.randn(2, 3, 3)),
    ("type: 'Exp'", RS.randn(2, 3, 3)),
    ("type: 'Log' log_param { base: 10 scale: 2 shift: 0.5 }", positive(2, 3, 3)),
    ("type: 'Log'", positive(2, 3, 3)),
    ("type: 'Clip' clip_param { min: -0.5 max: 0.7 }",
     np.concatenate([positive(2, 4, low=0.8), -positive(2, 4, low=0.6),
                     RS.uniform(-.4, .6, (2, 4))])),
    ("type: 'Swish' swish_param { beta: 1.5 }", RS.randn(2, 3, 3)),
    ("type: 'Dropout' dropout_param { dropout_ratio: 0.3 }", RS.randn(4, 5)),
]


@pytest.mark.parametrize('text, x', NEURON_GRADIENTS, ids=[t for t, _ in NEURON_GRADIENTS])
def test_neuron_gradient(text, x):
    check_gradient("name: 'n' bottom: 'x' top: 'y' " + text, [x])


def test_dropout_gradient_test_phase():
    check_gradient("name: 'd' type: 'Dropout' bottom: 'x' top: 'y'", [RS.randn(3, 4)], phase=TEST)


@pytest.mark.parametrize('shared', ['true', 'false'])
def test_prelu_gradient(shared):
    text = ("name: 'p' type: 'PReLU' bottom: 'x' top: 'y' prelu_param { channel_shared: %s "
            "filler { type: 'uniform' min: -0.5 max: 0.5 } }" % shared)
    check_gradient(text, [away_from_zero(2, 3, 2, 2)])


SHAPE_GRADIENTS = [
    ("type: 'Split' bottom: 'x' top: 'a' top: 'b' top: 'c'", [RS.randn(2, 3)], None),
    ("type: 'Concat' bottom: 'a' bottom: 'b' bottom: 'c' top: 'y'",
     [RS.randn(2, 1, 3), RS.randn(2, 2, 3), RS.randn(2, 3, 3)], None),
    ("type: 'Concat' bottom: 'a' bottom: 'b' top: 'y' concat_param { axis: -1 }",
     [RS.randn(2, 3, 1), RS.randn(2, 3, 2)], None),
    ("type: 'Concat' bottom: 'a' bottom: 'b' top: 'y' concat_param { concat_dim: 0 }",
     [RS.randn(1, 3), RS.randn(2, 3)], None),
    ("type: 'Slice' bottom: 'x' top: 'a' top: 'b' top: 'c' slice_param { slice_point: 1 "
     "slice_point: 3 }", [RS.randn(2, 6, 2)], None),
    ("type: 'Slice' bottom: 'x' top: 'a' top: 'b' slice_param { axis: 2 }",
     [RS.randn(2, 3, 4)], None),
    ("type: 'Slice' bottom: 'x' top: 'a' top: 'b' slice_param { slice_dim: 0 }",
     [RS.randn(4, 3)], None),
    ("type: 'Flatten' bottom: 'x' top: 'y'", [RS.randn(2, 3, 2, 2)], None),
    ("type: 'Flatten' bottom: 'x' top: 'y' flatten_param { axis: 1 end_axis: 2 }",
     [RS.randn(2, 3, 2, 2)], None),
    ("type: 'Reshape' bottom: 'x' top: 'y' reshape_param { shape { dim: 0 dim: -1 dim: 2 } }",
     [RS.randn(2, 3, 2, 2)], None),
    ("type: 'Reshape' bottom: 'x' top: 'y' reshape_param { axis: 1 num_axes: 1 "
     "shape { dim: 2 dim: 3 } }", [RS.randn(2, 6, 2)], None),
    ("type: 'Tile' bottom: 'x' top: 'y' tile_param { tiles: 3 }", [RS.randn(2, 2, 3)], None),
    ("type: 'Tile' bottom: 'x' top: 'y' tile_param { axis: -1 tiles: 2 }",
     [RS.randn(2, 2, 3)], None),
    ("type: 'Crop' bottom: 'x' bottom: 'r' top: 'y' crop_param { offset: 1 offset: 2 }",
     [RS.randn(2, 2, 5, 6), RS.randn(2, 2, 3, 3)], [0]),
    ("type: 'Crop' bottom: 'x' bottom: 'r' top: 'y' crop_param { axis: 1 offset: 1 }",
     [RS.randn(2, 3, 4), RS.randn(2, 2, 2)], [0]),
    ("type: 'Crop' bottom: 'x' bottom: 'r' top: 'y' crop_param { axis: 2 }",   # all of it
     [RS.randn(2, 2, 3, 4), RS.randn(2, 2, 3, 4)], [0]),
    ("type: 'Silence' bottom: 'x' bottom: 'z'", [RS.randn(2, 3), RS.randn(3)], None),
    ("type: 'BatchReindex' bottom: 'x' bottom: 'i' top: 'y'",
     [RS.randn(4, 2, 3), np.array([3., 0, 0, 2, 1, 3])], [0]),
    ("type: 'Filter' bottom: 'x' bottom: 't' bottom: 's' top: 'xf' top: 'tf'",
     [RS.randn(5, 2, 3), RS.randn(5, 2), np.array([1., 0, 1, 1, 0])], [0, 1]),
    ("type: 'Parameter' top: 'p' parameter_param { shape { dim: 2 dim: 3 } }", [], None),
    ("type: 'Reduction' bottom: 'x' top: 'y'", [RS.randn(2, 3, 2)], None),
    ("type: 'Reduction' bottom: 'x' top: 'y' reduction_param { operation: ASUM axis: 2 }",
     [away_from_zero(2, 3, 2)], None),
    ("type: 'Reduction' bottom: 'x' top: 'y' reduction_param { operation: SUMSQ axis: -1 }",
     [RS.randn(2, 3, 2)], None),
    ("type: 'Reduction' bottom: 'x' top: 'y' reduction_param { operation: MEAN axis: 1 "
     "coeff: 0.5 }", [RS.randn(2, 3, 2)], None),
    ("type: 'Eltwise' bottom: 'a' bottom: 'b' bottom: 'c' top: 'y' eltwise_param { "
     "coeff: 1 coeff: -0.5 coeff: 2 }", [RS.randn(2, 3), RS.randn(2, 3), RS.randn(2, 3)], None),
    ("type: 'Eltwise' bottom: 'a' bottom: 'b' bottom: 'c' top: 'y' eltwise_param { "
     "operation: PROD }", [RS.randn(2, 3), RS.randn(2, 3), RS.randn(2, 3)], None),
    ("type: 'Eltwise' bottom: 'a' bottom: 'b' bottom: 'c' top: 'y' eltwise_param { "
     "operation: PROD stable_prod_grad: false }",
     [away_from_zero(2, 3), away_from_zero(2, 3), away_from_zero(2, 3)], None),
    ("type: 'Eltwise' bottom: 'a' bottom: 'b' bottom: 'c' top: 'y' eltwise_param { "
     "operation: MAX }", list(RS.permutation(18).reshape(3, 2, 3) * 0.1), None),
]


@pytest.mark.parametrize('text, bottoms, check_bottom', SHAPE_GRADIENTS,
                         ids=[t[:60] for t, _, _ in SHAPE_GRADIENTS])
def test_shape_gradient(text, bottoms, check_bottom):
    check_gradient("name: 'l' " + text, bottoms, check_bottom=check_bottom)


SCALE_GRADIENTS = [
    ("type: 'Scale' bottom: 'x' top: 'y' scale_param { filler { type: 'gaussian' } "
     "bias_term: true bias_filler { type: 'gaussian' } }", [RS.randn(2, 3, 2, 2)]),
    ("type: 'Scale' bottom: 'x' top: 'y' scale_param { axis: 1 num_axes: 2 "
     "filler { type: 'gaussian' } }", [RS.randn(2, 3, 2, 2)]),
    ("type: 'Scale' bottom: 'x' top: 'y' scale_param { num_axes: 0 filler { value: 1.5 } }",
     [RS.randn(2, 3, 2)]),
    ("type: 'Scale' bottom: 'x' top: 'y' scale_param { axis: -2 num_axes: -1 "
     "filler { type: 'gaussian' } }", [RS.randn(2, 3, 2)]),
    ("type: 'Scale' bottom: 'x' bottom: 's' top: 'y'", [RS.randn(2, 3, 4), RS.randn(3, 4)]),
    ("type: 'Scale' bottom: 'x' bottom: 's' top: 'y' scale_param { axis: 0 bias_term: true "
     "bias_filler { type: 'gaussian' } }", [RS.randn(2, 3, 2), RS.randn(2, 3)]),
    ("type: 'Bias' bottom: 'x' top: 'y' bias_param { filler { type: 'gaussian' } }",
     [RS.randn(2, 3, 2)]),
    ("type: 'Bias' bottom: 'x' top: 'y' bias_param { num_axes: 0 filler { value: 1 } }",
     [RS.randn(2, 3, 2)]),
    ("type: 'Bias' bottom: 'x' bottom: 'b' top: 'y' bias_param { axis: 2 }",
     [RS.randn(2, 3, 2, 4), RS.randn(2, 4)]),
    ("type: 'Softmax' bottom: 'x' top: 'y'", [RS.randn(2, 4, 3)]),
    ("type: 'Softmax' bottom: 'x' top: 'y' softmax_param { axis: 2 }", [RS.randn(2, 4, 3)]),
    ("type: 'MVN' bottom: 'x' top: 'y'", [RS.randn(2, 3, 2, 3)]),
    ("type: 'MVN' bottom: 'x' top: 'y' mvn_param { normalize_variance: false }",
     [RS.randn(2, 3, 2, 3)]),
    ("type: 'MVN' bottom: 'x' top: 'y' mvn_param { across_channels: true }",
     [RS.randn(2, 3, 2, 2)]),
]


@pytest.mark.parametrize('text, bottoms', SCALE_GRADIENTS, ids=[t[:60] for t, _ in SCALE_GRADIENTS])
def test_scale_softmax_gradient(text, bottoms):
    check_gradient("name: 'l' " + text, bottoms)


# ---------------------------------------------------------------- in-place runs

IN_PLACE = [
    ("type: 'ReLU' relu_param { negative_slope: 0.2 }", [away_from_zero(2, 3, 2)]),
    ("type: 'PReLU' prelu_param { filler { type: 'gaussian' } }", [away_from_zero(2, 3, 2)]),
    ("type: 'ELU'", [away_from_zero(2, 3, 2)]),
    ("type: 'Sigmoid'", [RS.randn(2, 3)]),
    ("type: 'TanH'", [RS.randn(2, 3)]),
    ("type: 'AbsVal'", [away_from_zero(2, 3)]),
    ("type: 'BNLL'", [RS.randn(2, 3)]),
    ("type: 'Power' power_param { power: 2 shift: 1 }", [RS.randn(2, 3)]),
    ("type: 'Exp'", [RS.randn(2, 3)]),
    ("type: 'Log'", [positive(2, 3)]),
    ("type: 'Clip' clip_param { min: -0.5 max: 0.5 }", [RS.randn(3, 4)]),
    ("type: 'Swish'", [RS.randn(2, 3)]),
    ("type: 'Dropout'", [RS.randn(3, 4)]),
    ("type: 'Scale' scale_param { filler { type: 'gaussian' } bias_term: true }",
     [RS.randn(2, 3, 2)]),
    ("type: 'Bias' bias_param { filler { type: 'gaussian' } }", [RS.randn(2, 3, 2)]),
    ("type: 'Softmax'", [RS.randn(2, 3, 2)]),
    ("type: 'MVN'", [RS.randn(2, 3, 4)]),
    ("type: 'Eltwise' bottom: 'b' eltwise_param { coeff: 2 coeff: 3 }",
     [RS.randn(2, 3), RS.randn(2, 3)]),
]


def _run(text, bottoms, in_place, seed=3):
    """Forward and backward once; in place, the top is bottom 0's blob."""
    set_random_seed(seed)   # the same filler values in both runs
    layer, bottom, top = build_layer("name: 'l' bottom: 'x' top: 'y' " + text, bottoms, seed=seed)
    if in_place:
        top = [bottom[0]]
        layer.reshape(bottom, top)
    weights = np.random.RandomState(seed).randn(*bottom[0].shape)
    layer.forward(bottom, top)
    output = top[0].data.copy()
    top[0].diff[...] = weights
    layer.backward(top, [True] * len(bottom), bottom)
    return output, [b.diff.copy() for b in bottom], [b.diff.copy() for b in layer.blobs]


@pytest.mark.parametrize('text, bottoms', IN_PLACE, ids=[t[:40] for t, _ in IN_PLACE])
def test_in_place_matches_out_of_place(text, bottoms):
    expected = _run(text, bottoms, in_place=False)
    actual = _run(text, bottoms, in_place=True)
    np.testing.assert_allclose(actual[0], expected[0], rtol=1e-12)
    for a, e in zip(actual[1] + actual[2], expected[1] + expected[2]):
        np.testing.assert_allclose(a, e, rtol=1e-12)


# ---------------------------------------------------------------- Caffe corner cases

def _forward(text, bottoms, phase=TRAIN, dtype=np.float64):
    layer, bottom, top = build_layer(text, bottoms, phase=phase, dtype=dtype)
    layer.forward(bottom, top)
    return layer, bottom, top


def test_argmax_ties_take_the_larger_index():
    x = np.array([[1., 3, 3, 0, 3]])
    _, _, top = _forward("name: 'a' type: 'ArgMax' bottom: 'x' top: 'y' "
                         "argmax_param { top_k: 2 out_max_val: true }", [x])
    np.testing.assert_array_equal(top[0].data.reshape(2, 2), [[4, 2], [3, 3]])
    _, _, top = _forward("name: 'a' type: 'ArgMax' bottom: 'x' top: 'y' argmax_param { axis: 1 }",
                         [x])
    np.testing.assert_array_equal(top[0].data, [[4]])


def test_eltwise_max_tie_rule():
    # bottom 1 wins a tie with bottom 0; a later bottom must be strictly larger
    a, b, c = np.ones((1, 2)), np.ones((1, 2)), np.array([[1., 2.]])
    layer, bottom, top = _forward("name: 'e' type: 'Eltwise' bottom: 'a' bottom: 'b' bottom: 'c' "
                                  "top: 'y' eltwise_param { operation: MAX }", [a, b, c])
    top[0].diff[...] = 1
    layer.backward(top, [True] * 3, bottom)
    np.testing.assert_array_equal([bl.diff[0] for bl in bottom], [[0, 0], [1, 0], [0, 1]])


def test_dropout_train_scales_and_test_is_identity():
    x = np.ones((200, 50))
    _, _, top = _forward("name: 'd' type: 'Dropout' bottom: 'x' top: 'y' "
                         "dropout_param { dropout_ratio: 0.25 }", [x])
    kept = top[0].data != 0
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(top[0].data[kept], 1 / 0.75)
    _, _, top = _forward("name: 'd' type: 'Dropout' bottom: 'x' top: 'y'", [x], phase=TEST)
    np.testing.assert_array_equal(top[0].data, x)


def test_filter_first_reshape_keeps_the_batch_size():
    text = "name: 'f' type: 'Filter' bottom: 'x' bottom: 's' top: 'y'"
    layer, bottom, top = build_layer(text, [np.arange(4.).reshape(4, 1), np.zeros(4)])
    assert top[0].shape == (4, 1)
    bottom[1].data[...] = [0, 1, 0, 1]
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data.ravel(), [1, 3])
    assert not layer.allow_force_backward(1) and layer.allow_force_backward(0)


def test_reshape_and_flatten_share_data():
    x = RS.randn(2, 3, 4)
    layer, bottom, top = _forward("name: 'r' type: 'Reshape' bottom: 'x' top: 'y' "
                                  "reshape_param { shape { dim: -1 dim: 4 } }", [x])
    assert top[0].shape == (6, 4)
    bottom[0].data[0, 0, 0] = 42
    assert top[0].data[0, 0] == 42


def test_prelu_default_filler_and_shapes():
    layer, _, _ = build_layer("name: 'p' type: 'PReLU' bottom: 'x' top: 'y'", [RS.randn(2, 3)])
    np.testing.assert_array_equal(layer.blobs[0].data, [0.25] * 3)
    layer, _, _ = build_layer("name: 'p' type: 'PReLU' bottom: 'x' top: 'y' "
                              "prelu_param { channel_shared: true }", [RS.randn(2, 3)])
    assert layer.blobs[0].shape == ()


def test_scale_blobs_and_defaults():
    layer, _, _ = build_layer("name: 's' type: 'Scale' bottom: 'x' top: 'y' "
                              "scale_param { bias_term: true }", [RS.randn(2, 3, 2)])
    assert [b.shape for b in layer.blobs] == [(3,), (3,)]
    np.testing.assert_array_equal(layer.blobs[0].data, 1)
    np.testing.assert_array_equal(layer.blobs[1].data, 0)
    layer, _, _ = build_layer("name: 's' type: 'Scale' bottom: 'x' bottom: 's' top: 'y' "
                              "scale_param { bias_term: true }",
                              [RS.randn(2, 3, 2), RS.randn(3, 2)])
    assert [b.shape for b in layer.blobs] == [(3, 2)]


def test_float32_stays_float32():
    x = RS.randn(2, 3).astype(np.float32)
    for text in ["type: 'Exp' exp_param { base: 2 shift: 1 }", "type: 'Log' log_param { base: 3 }",
                 "type: 'Scale'", "type: 'MVN'", "type: 'Power' power_param { power: 2 }"]:
        _, _, top = _forward("name: 'l' bottom: 'x' top: 'y' " + text, [np.abs(x) + 0.1],
                             dtype=np.float32)
        assert top[0].data.dtype == np.float32


@pytest.mark.parametrize('text, bottoms, message', [
    ("type: 'Concat' bottom: 'a' bottom: 'b' top: 'y'", [np.zeros((2, 3, 4)), np.zeros((2, 3, 5))],
     'must match except on axis 1'),
    ("type: 'Slice' bottom: 'x' top: 'a' top: 'b'", [np.zeros((2, 3))], 'does not split equally'),
    ("type: 'Reshape' bottom: 'x' top: 'y' reshape_param { shape { dim: 5 dim: -1 } }",
     [np.zeros((2, 3))], 'cannot infer'),
    ("type: 'Crop' bottom: 'x' bottom: 'r' top: 'y' crop_param { offset: 2 }",
     [np.zeros((1, 1, 4, 4)), np.zeros((1, 1, 3, 3))], 'too small'),
    ("type: 'Eltwise' bottom: 'a' bottom: 'b' top: 'y'", [np.zeros((2, 3)), np.zeros((3, 2))],
     'same shape'),
    ("type: 'Scale' bottom: 'x' bottom: 's' top: 'y'", [np.zeros((2, 3)), np.zeros(2)],
     'does not match'),
    ("type: 'BatchReindex' bottom: 'x' bottom: 'i' top: 'y'", [np.zeros((2, 3)), np.array([2.])],
     'indices must be in'),
    ("type: 'ArgMax' bottom: 'x' top: 'y' argmax_param { top_k: 4 }", [np.zeros((2, 3))],
     'top_k 4'),
])
def test_bad_input_names_the_layer(text, bottoms, message):
    with pytest.raises(CaffeError, match=message) as info:
        _forward("name: 'bad' " + text, bottoms)
    assert "'bad'" in str(info.value)


def test_forward_only_layers_refuse_backward():
    for text in ["type: 'Threshold'", "type: 'ArgMax'"]:
        layer, bottom, top = _forward("name: 'l' bottom: 'x' top: 'y' " + text, [RS.randn(2, 3)])
        with pytest.raises(CaffeError, match='no gradient'):
            layer.backward(top, [True], bottom)


def test_parameter_top_is_the_blob():
    layer, _, top = build_layer(layer_param("name: 'p' type: 'Parameter' top: 'p' "
                                            "parameter_param { shape { dim: 2 } }"), [])
    layer.blobs[0].data[...] = [1, 2]
    layer.forward([], top)
    np.testing.assert_array_equal(top[0].data, [1, 2])
    assert isinstance(top[0], Blob)
