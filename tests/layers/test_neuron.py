"""Neuron layers (ReLU, PReLU, ELU, Sigmoid, TanH, AbsVal, BNLL, Power, Exp, Log, Threshold,
Clip, Swish, Dropout): Caffe's golden outputs on every engine (the engine fixture),
finite-difference gradients, in-place runs and Caffe's corner cases. The forks' ReLU6 and
Dropout's scale_train against loops written from the forks' sources."""
import numpy as np
import pytest

from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layer import TEST
from caffe_syncbn.testing import build_layer, check_gradient
from helpers.golden_layer_case import net_layer_cases, run_net_layer_case
from helpers.layer_checks import (RS, assert_in_place_matches_out_of_place, away_from_zero,
                                  forward, positive)

TYPES = ['ReLU', 'PReLU', 'ELU', 'Sigmoid', 'TanH', 'AbsVal', 'BNLL', 'Power', 'Exp', 'Log',
         'Threshold', 'Clip', 'Swish', 'Dropout']


@pytest.mark.parametrize('case_name, layer_name', net_layer_cases(TYPES))
def test_golden(case_name, layer_name, engine):
    run_net_layer_case(case_name, layer_name, engine)


# ---------------------------------------------------------------- gradient checks

GRADIENTS = [
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
    ("type: 'Dropout' dropout_param { dropout_ratio: 0.3 scale_train: false }", RS.randn(4, 5)),
    ("type: 'ReLU6'", np.concatenate([away_from_zero(2, 4) * 3, positive(2, 4, low=6.5, high=9)])),
    ("type: 'ReLU6' relu_param { negative_slope: 0.2 }", away_from_zero(3, 4) * 4),
]


@pytest.mark.parametrize('text, x', GRADIENTS, ids=[t for t, _ in GRADIENTS])
def test_neuron_gradient(text, x):
    check_gradient("name: 'n' bottom: 'x' top: 'y' " + text, [x])


@pytest.mark.parametrize('settings', ['', 'dropout_param { scale_train: false }'])
def test_dropout_gradient_test_phase(settings):
    check_gradient("name: 'd' type: 'Dropout' bottom: 'x' top: 'y' " + settings, [RS.randn(3, 4)],
                   phase=TEST)


@pytest.mark.parametrize('shared', ['true', 'false'])
def test_prelu_gradient(shared):
    text = ("name: 'p' type: 'PReLU' bottom: 'x' top: 'y' prelu_param { channel_shared: %s "
            "filler { type: 'uniform' min: -0.5 max: 0.5 } }" % shared)
    check_gradient(text, [away_from_zero(2, 3, 2, 2)])


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
    ("type: 'ReLU6'", [RS.randn(3, 4) * 5]),
    ("type: 'ReLU6' relu_param { negative_slope: 0.1 }", [RS.randn(3, 4) * 5]),
]


@pytest.mark.parametrize('text, bottoms', IN_PLACE, ids=[t[:40] for t, _ in IN_PLACE])
def test_in_place_matches_out_of_place(text, bottoms):
    assert_in_place_matches_out_of_place(text, bottoms)


# ---------------------------------------------------------------- Caffe corner cases

def test_dropout_train_scales_and_test_is_identity():
    x = np.ones((200, 50))
    _, _, top = forward("name: 'd' type: 'Dropout' bottom: 'x' top: 'y' "
                        "dropout_param { dropout_ratio: 0.25 }", [x])
    kept = top[0].data != 0
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(top[0].data[kept], 1 / 0.75)
    _, _, top = forward("name: 'd' type: 'Dropout' bottom: 'x' top: 'y'", [x], phase=TEST)
    np.testing.assert_array_equal(top[0].data, x)


def test_prelu_default_filler_and_shapes():
    layer, _, _ = build_layer("name: 'p' type: 'PReLU' bottom: 'x' top: 'y'", [RS.randn(2, 3)])
    np.testing.assert_array_equal(layer.blobs[0].data, [0.25] * 3)
    layer, _, _ = build_layer("name: 'p' type: 'PReLU' bottom: 'x' top: 'y' "
                              "prelu_param { channel_shared: true }", [RS.randn(2, 3)])
    assert layer.blobs[0].shape == ()


def test_float32_stays_float32():
    x = RS.randn(2, 3).astype(np.float32)
    for text in ["type: 'Exp' exp_param { base: 2 shift: 1 }", "type: 'Log' log_param { base: 3 }",
                 "type: 'Power' power_param { power: 2 }"]:
        _, _, top = forward("name: 'l' bottom: 'x' top: 'y' " + text, [np.abs(x) + 0.1],
                            dtype=np.float32)
        assert top[0].data.dtype == np.float32


def test_threshold_refuses_backward():
    layer, bottom, top = forward("name: 'l' bottom: 'x' top: 'y' type: 'Threshold'",
                                 [RS.randn(2, 3)])
    with pytest.raises(CaffeError, match='no gradient'):
        layer.backward(top, [True], bottom)


# ---------------------------------------------------------------- the forks' settings

def test_dropout_scale_train_false_scales_at_test_instead():
    """caffe-fast-rcnn's and R-FCN's Dropout (scale_train: false): TRAIN keeps values as they
    are, TEST multiplies by 1 - ratio, and each backward is its forward's."""
    x = RS.randn(300, 40)
    text = ("name: 'd' type: 'Dropout' bottom: 'x' top: 'y' "
            "dropout_param { dropout_ratio: 0.25 scale_train: false }")
    layer, bottom, top = forward(text, [x])
    kept = top[0].data != 0
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_array_equal(top[0].data[kept], x[kept])
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    np.testing.assert_array_equal(bottom[0].diff, kept)
    layer, bottom, top = forward(text, [x], phase=TEST)
    np.testing.assert_allclose(top[0].data, 0.75 * x, rtol=1e-15)
    top[0].diff[...] = 2
    layer.backward(top, [True], bottom)
    np.testing.assert_allclose(bottom[0].diff, 1.5, rtol=1e-15)


def relu6_reference(x):
    """chuanqi305/ssd's ReLU6, element by element: min(max(x, 0), 6), gradient 1 where
    0 < x < 6."""
    y, passes = np.empty_like(x), np.empty_like(x)
    for i, value in np.ndenumerate(x):
        y[i] = min(max(value, 0.0), 6.0)
        passes[i] = 1.0 if 0 < value < 6 else 0.0
    return y, passes


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('in_place', [False, True])
def test_relu6_is_the_forks_at_its_kinks(dtype, in_place):
    x = np.concatenate([RS.randn(3, 8) * 5, [[0, -0.0, 6, 6.0001, 5.9999, -1e-7, 1e-7, 80]]])
    x = x.astype(dtype)
    expected, passes = relu6_reference(x.astype(np.float64))
    layer, bottom, top = build_layer("name: 'r' type: 'ReLU6' bottom: 'x' top: 'y'", [x],
                                     dtype=dtype)
    if in_place:
        top = bottom
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data, expected.astype(dtype))
    dy = RS.randn(*x.shape).astype(dtype)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    np.testing.assert_array_equal(bottom[0].diff, (dy * passes).astype(dtype))


def test_relu6_with_a_negative_slope():
    x = np.array([[-3.0, -0.5, 0.0, 2.0, 6.0, 9.0]])
    _, _, top = forward("name: 'r' type: 'ReLU6' bottom: 'x' top: 'y' "
                        "relu_param { negative_slope: 0.1 }", [x])
    slope = float(np.float32(0.1))          # a float field, as Caffe reads it
    np.testing.assert_allclose(top[0].data, [[-3 * slope, -0.5 * slope, 0, 2, 6, 6]],
                               rtol=1e-15)
