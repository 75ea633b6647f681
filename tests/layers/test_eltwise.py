"""Eltwise: Caffe's golden outputs and every engine against the float64 array engine (the
engine fixture), the SUM + ReLU chain of the memory plans on every engine,
finite-difference gradients, in-place runs and Caffe's tie rule."""
import numpy as np
import pytest

from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layer import create_layer
from caffe_syncbn.testing import check_gradient, layer_param
from helpers.engines import TOLERANCE, Engine
from helpers.golden_layer_case import net_layer_cases, run_net_layer_case
from helpers.layer_checks import RS, assert_in_place_matches_out_of_place, away_from_zero, forward


@pytest.mark.parametrize('case_name, layer_name', net_layer_cases(['Eltwise']))
def test_golden(case_name, layer_name, engine):
    run_net_layer_case(case_name, layer_name, engine)


def _sum_relu(engine, coeffs, slope, dtype, bottoms=2):
    """A SUM that absorbed the ReLU after it (Layer.absorb, as the memory plans chain them):
    the ReLU's top, and each bottom's gradient through the ReLU."""
    text = ("name: 'e' type: 'Eltwise' %s top: 'y' eltwise_param { %s }"
            % (' '.join("bottom: 'b%d'" % i for i in range(bottoms)),
               ' '.join('coeff: %g' % c for c in coeffs)))
    rs = np.random.RandomState(4)
    layer, bottom, top = engine.build(text, [rs.standard_normal((3, 4, 5))
                                             for _ in range(bottoms)], dtype=dtype)
    relu = create_layer(layer_param("name: 'r' type: 'ReLU' bottom: 'y' top: 'y' "
                                    "relu_param { negative_slope: %g }" % slope), layer.ctx)
    assert layer.absorb(relu, top[0])
    layer.forward(bottom, top)
    top[0].diff[...] = engine.xp.asarray(rs.standard_normal((3, 4, 5)).astype(dtype))
    layer.backward(top, [True] * bottoms, bottom)
    return [engine.host(top[0].data)] + [engine.host(b.diff) for b in bottom]


@pytest.mark.parametrize('coeffs, slope, bottoms', [([1, 1], 0, 2), ([2, -0.5], 0.1, 2),
                                                    ([1, 2, -1], 0.2, 3)])
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_sum_with_its_relu_on_every_engine(engine, coeffs, slope, bottoms, dtype):
    with pytest.MonkeyPatch.context() as patch:
        want = _sum_relu(Engine('array', patch), coeffs, slope, np.float64, bottoms)
    got = _sum_relu(engine, coeffs, slope, dtype, bottoms)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


GRADIENTS = [
    ("type: 'Eltwise' bottom: 'a' bottom: 'b' bottom: 'c' top: 'y' eltwise_param { "
     "coeff: 1 coeff: -0.5 coeff: 2 }", [RS.randn(2, 3), RS.randn(2, 3), RS.randn(2, 3)]),
    ("type: 'Eltwise' bottom: 'a' bottom: 'b' bottom: 'c' top: 'y' eltwise_param { "
     "operation: PROD }", [RS.randn(2, 3), RS.randn(2, 3), RS.randn(2, 3)]),
    ("type: 'Eltwise' bottom: 'a' bottom: 'b' bottom: 'c' top: 'y' eltwise_param { "
     "operation: PROD stable_prod_grad: false }",
     [away_from_zero(2, 3), away_from_zero(2, 3), away_from_zero(2, 3)]),
    ("type: 'Eltwise' bottom: 'a' bottom: 'b' bottom: 'c' top: 'y' eltwise_param { "
     "operation: MAX }", list(RS.permutation(18).reshape(3, 2, 3) * 0.1)),
]


@pytest.mark.parametrize('text, bottoms', GRADIENTS, ids=[t[:60] for t, _ in GRADIENTS])
def test_eltwise_gradient(text, bottoms):
    check_gradient("name: 'l' " + text, bottoms)


def test_in_place_matches_out_of_place():
    assert_in_place_matches_out_of_place(
        "type: 'Eltwise' bottom: 'b' eltwise_param { coeff: 2 coeff: 3 }",
        [RS.randn(2, 3), RS.randn(2, 3)])


def test_eltwise_max_tie_rule():
    # bottom 1 wins a tie with bottom 0; a later bottom must be strictly larger
    a, b, c = np.ones((1, 2)), np.ones((1, 2)), np.array([[1., 2.]])
    layer, bottom, top = forward("name: 'e' type: 'Eltwise' bottom: 'a' bottom: 'b' bottom: 'c' "
                                 "top: 'y' eltwise_param { operation: MAX }", [a, b, c])
    top[0].diff[...] = 1
    layer.backward(top, [True] * 3, bottom)
    np.testing.assert_array_equal([bl.diff[0] for bl in bottom], [[0, 0], [1, 0], [0, 1]])


def test_bottoms_of_two_shapes_name_the_layer():
    with pytest.raises(CaffeError, match='same shape') as info:
        forward("name: 'bad' type: 'Eltwise' bottom: 'a' bottom: 'b' top: 'y'",
                [np.zeros((2, 3)), np.zeros((3, 2))])
    assert "'bad'" in str(info.value)
