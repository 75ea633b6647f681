"""Neuron layers (ReLU, PReLU, ELU, Sigmoid, TanH, AbsVal, BNLL, Power, Exp, Log, Threshold,
Clip, Swish, Dropout): Caffe's golden outputs on every engine (the engine fixture),
finite-difference gradients, in-place runs and Caffe's corner cases."""
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
]


@pytest.mark.parametrize('text, x', GRADIENTS, ids=[t for t, _ in GRADIENTS])
def test_neuron_gradient(text, x):
    check_gradient("name: 'n' bottom: 'x' top: 'y' " + text, [x])


def test_dropout_gradient_test_phase():
    check_gradient("name: 'd' type: 'Dropout' bottom: 'x' top: 'y'", [RS.randn(3, 4)], phase=TEST)


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
