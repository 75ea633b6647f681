"""Softmax: Caffe's golden outputs on every engine (the engine fixture), finite-difference
gradients and in-place runs. SoftmaxWithLoss: test_loss.py."""
import pytest

from caffe_syncbn.testing import check_gradient
from helpers.golden_layer_case import net_layer_cases, run_net_layer_case
from helpers.layer_checks import RS, assert_in_place_matches_out_of_place


@pytest.mark.parametrize('case_name, layer_name', net_layer_cases(['Softmax']))
def test_golden(case_name, layer_name, engine):
    run_net_layer_case(case_name, layer_name, engine)


@pytest.mark.parametrize('axis', [1, 2])
def test_softmax_gradient(axis):
    check_gradient("name: 'l' type: 'Softmax' bottom: 'x' top: 'y' softmax_param { axis: %d }"
                   % axis, [RS.randn(2, 4, 3)])


def test_in_place_matches_out_of_place():
    assert_in_place_matches_out_of_place("type: 'Softmax'", [RS.randn(2, 3, 2)])
