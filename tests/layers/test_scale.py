"""Scale and Bias: Caffe's golden outputs on every engine (the engine fixture),
finite-difference gradients, in-place runs, their blobs and defaults. SENet's Axpy:
test_fork_layers.py."""
import numpy as np
import pytest

from caffe_syncbn.errors import CaffeError
from caffe_syncbn.testing import build_layer, check_gradient
from helpers.golden_layer_case import net_layer_cases, run_net_layer_case
from helpers.layer_checks import RS, assert_in_place_matches_out_of_place, forward


@pytest.mark.parametrize('case_name, layer_name', net_layer_cases(['Scale', 'Bias']))
def test_golden(case_name, layer_name, engine):
    run_net_layer_case(case_name, layer_name, engine)


GRADIENTS = [
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
]


@pytest.mark.parametrize('text, bottoms', GRADIENTS, ids=[t[:60] for t, _ in GRADIENTS])
def test_scale_gradient(text, bottoms):
    check_gradient("name: 'l' " + text, bottoms)


IN_PLACE = [
    ("type: 'Scale' scale_param { filler { type: 'gaussian' } bias_term: true }",
     [RS.randn(2, 3, 2)]),
    ("type: 'Bias' bias_param { filler { type: 'gaussian' } }", [RS.randn(2, 3, 2)]),
]


@pytest.mark.parametrize('text, bottoms', IN_PLACE, ids=[t[:40] for t, _ in IN_PLACE])
def test_in_place_matches_out_of_place(text, bottoms):
    assert_in_place_matches_out_of_place(text, bottoms)


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
    _, _, top = forward("name: 'l' bottom: 'x' top: 'y' type: 'Scale'",
                        [RS.randn(2, 3).astype(np.float32)], dtype=np.float32)
    assert top[0].data.dtype == np.float32


def test_a_scale_of_another_shape_names_the_layer():
    with pytest.raises(CaffeError, match='does not match') as info:
        forward("name: 'bad' type: 'Scale' bottom: 'x' bottom: 's' top: 'y'",
                [np.zeros((2, 3)), np.zeros(2)])
    assert "'bad'" in str(info.value)
