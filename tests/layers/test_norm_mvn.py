"""MVN: Caffe's golden outputs on every engine (the engine fixture), finite-difference
gradients, in-place runs and float32. SSD's Normalize: test_detection.py."""
import numpy as np
import pytest

from caffe_syncbn.testing import check_gradient
from helpers.golden_layer_case import net_layer_cases, run_net_layer_case
from helpers.layer_checks import RS, assert_in_place_matches_out_of_place, forward


@pytest.mark.parametrize('case_name, layer_name', net_layer_cases(['MVN']))
def test_golden(case_name, layer_name, engine):
    run_net_layer_case(case_name, layer_name, engine)


@pytest.mark.parametrize('param', ['', 'mvn_param { normalize_variance: false }',
                                   'mvn_param { across_channels: true }'])
def test_mvn_gradient(param):
    check_gradient("name: 'l' type: 'MVN' bottom: 'x' top: 'y' " + param,
                   [RS.randn(2, 3, 2, 3)])


def test_in_place_matches_out_of_place():
    assert_in_place_matches_out_of_place("type: 'MVN'", [RS.randn(2, 3, 4)])


def test_float32_stays_float32():
    _, _, top = forward("name: 'l' bottom: 'x' top: 'y' type: 'MVN'",
                        [RS.randn(2, 3).astype(np.float32)], dtype=np.float32)
    assert top[0].data.dtype == np.float32
