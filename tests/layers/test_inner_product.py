"""InnerProduct and Embed: Caffe's golden outputs, finite-difference gradients and the
corner cases of each."""
import numpy as np
import pytest
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.testing import build_layer
from helpers.arrays import randn
from helpers.golden_layer_case import ATOL, RTOL, run_single_layer_case, single_layer_cases
from helpers.layer_checks import forward
from helpers.paths import GOLDEN, require


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('case', single_layer_cases(['InnerProduct', 'Embed']))
def test_golden_single_layer(case, dtype, engine, monkeypatch):
    run_single_layer_case(case, monkeypatch, dtype=dtype, engine=engine)


def test_golden_embed():
    """Embed feeds an EuclideanLoss in its case; its top diff is the recorded diff/emb."""
    require(GOLDEN / 'embed.npz')
    net = text_format.Parse((GOLDEN / 'embed.prototxt').read_text(), caffe_pb2.NetParameter())
    (param,) = [lp for lp in net.layer if lp.type == 'Embed']
    ref = np.load(GOLDEN / 'embed.npz')
    layer, bottom, top = build_layer(param, [ref['data/idx']], dtype=np.float32)
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = ref['param_after/embed/%d' % i]
    layer.forward(bottom, top)
    np.testing.assert_allclose(top[0].data, ref['data/emb'], rtol=RTOL, atol=ATOL)
    assert layer.allow_force_backward(0) is False
    top[0].diff[...] = ref['diff/emb']
    layer.backward(top, [False], bottom)
    for i, blob in enumerate(layer.blobs):
        np.testing.assert_allclose(blob.diff, ref['param_diff/embed/%d' % i],
                                   rtol=RTOL, atol=ATOL)


def _ip(body):
    return ('name: "f" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { %s '
            'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" } }'
            % body)


@pytest.mark.parametrize('body, shape, out', [
    ('num_output: 3', (2, 2, 3), (2, 3)),
    ('num_output: 4 axis: 2', (2, 3, 5), (2, 3, 4)),
    ('num_output: 3 transpose: true', (2, 4), (2, 3)),
    ('num_output: 2 bias_term: false axis: -1', (3, 2, 3), (3, 2, 2)),
])
def test_inner_product(host_engine, body, shape, out):
    layer, _, top = forward(_ip(body), [randn(*shape)])
    assert top[0].shape == out
    host_engine.check_gradient(_ip(body), [randn(*shape)])


def test_inner_product_rejects_a_changed_input_size():
    layer, bottom, top = build_layer(_ip('num_output: 3'), [randn(2, 4)])
    bottom[0].reshape(2, 5)
    with pytest.raises(CaffeError, match='expected 4 inputs'):
        layer.reshape(bottom, top)


_EMBED = ('name: "e" type: "Embed" bottom: "i" top: "y" embed_param { num_output: 3 '
          'input_dim: 5 weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }')


def test_embed_forward_and_param_gradient(host_engine):
    idx = np.array([[1, 4], [1, 0]], float)
    layer, _, top = forward(_EMBED, [idx])
    assert top[0].shape == (2, 2, 3)
    np.testing.assert_allclose(top[0].data[1, 0], layer.blobs[0].data[1] + layer.blobs[1].data)
    host_engine.check_gradient(_EMBED, [idx], check_bottom=[])


@pytest.mark.parametrize('idx, message', [([0.5], 'integers'), ([5], r'\[0, 5\)')])
def test_embed_rejects_bad_indices(idx, message):
    layer, bottom, top = build_layer(_EMBED, [np.array(idx)])
    with pytest.raises(CaffeError, match=message):
        layer.forward(bottom, top)


def test_embed_has_no_bottom_gradient():
    layer, bottom, top = forward(_EMBED, [np.array([1.0])])
    assert not layer.allow_force_backward(0)
    with pytest.raises(CaffeError, match='backpropagate'):
        layer.backward(top, [True], bottom)
