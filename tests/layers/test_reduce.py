"""ArgMax and Reduction: Caffe's golden outputs on every engine (the engine fixture),
finite-difference gradients and Caffe's corner cases."""
import numpy as np
import pytest

from caffe_syncbn.errors import CaffeError
from caffe_syncbn.testing import check_gradient
from helpers.golden_layer_case import net_layer_cases, run_net_layer_case
from helpers.layer_checks import RS, away_from_zero, forward


@pytest.mark.parametrize('case_name, layer_name', net_layer_cases(['ArgMax', 'Reduction']))
def test_golden(case_name, layer_name, engine):
    run_net_layer_case(case_name, layer_name, engine)


GRADIENTS = [
    ("type: 'Reduction' bottom: 'x' top: 'y'", [RS.randn(2, 3, 2)]),
    ("type: 'Reduction' bottom: 'x' top: 'y' reduction_param { operation: ASUM axis: 2 }",
     [away_from_zero(2, 3, 2)]),
    ("type: 'Reduction' bottom: 'x' top: 'y' reduction_param { operation: SUMSQ axis: -1 }",
     [RS.randn(2, 3, 2)]),
    ("type: 'Reduction' bottom: 'x' top: 'y' reduction_param { operation: MEAN axis: 1 "
     "coeff: 0.5 }", [RS.randn(2, 3, 2)]),
]


@pytest.mark.parametrize('text, bottoms', GRADIENTS, ids=[t[:60] for t, _ in GRADIENTS])
def test_reduction_gradient(text, bottoms):
    check_gradient("name: 'l' " + text, bottoms)


def test_argmax_ties_take_the_larger_index():
    x = np.array([[1., 3, 3, 0, 3]])
    _, _, top = forward("name: 'a' type: 'ArgMax' bottom: 'x' top: 'y' "
                        "argmax_param { top_k: 2 out_max_val: true }", [x])
    np.testing.assert_array_equal(top[0].data.reshape(2, 2), [[4, 2], [3, 3]])
    _, _, top = forward("name: 'a' type: 'ArgMax' bottom: 'x' top: 'y' argmax_param { axis: 1 }",
                        [x])
    np.testing.assert_array_equal(top[0].data, [[4]])


def test_argmax_top_k_past_the_axis_names_the_layer():
    with pytest.raises(CaffeError, match='top_k 4') as info:
        forward("name: 'bad' type: 'ArgMax' bottom: 'x' top: 'y' argmax_param { top_k: 4 }",
                [np.zeros((2, 3))])
    assert "'bad'" in str(info.value)


def test_argmax_refuses_backward():
    layer, bottom, top = forward("name: 'l' bottom: 'x' top: 'y' type: 'ArgMax'",
                                 [RS.randn(2, 3)])
    with pytest.raises(CaffeError, match='no gradient'):
        layer.backward(top, [True], bottom)
