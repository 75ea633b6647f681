"""LRN across and within channels: Caffe's golden outputs and every engine against the float64
array engine (the engine fixture), finite-difference gradients, the formula, and the host
engine's bands."""
import numpy as np
import pytest

from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layers.lrn import host as lrn_host
from caffe_syncbn.testing import build_layer
from helpers.arrays import randn
from helpers.engines import assert_matches, reference
from helpers.golden_layer_case import run_single_layer_case, single_layer_cases
from helpers.layer_checks import forward


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('case', single_layer_cases(['LRN']))
def test_golden_single_layer(case, dtype, engine, monkeypatch):
    run_single_layer_case(case, monkeypatch, dtype=dtype, engine=engine)


@pytest.mark.parametrize('body', [
    'local_size: 1 alpha: 0.5 beta: 0.75 k: 2',
    'local_size: 3 alpha: 0.5 beta: 0.75 k: 2',
    'local_size: 5 alpha: 0.1 beta: 0.75 k: 2',
    'local_size: 3 alpha: 0.3 beta: 0.6 norm_region: WITHIN_CHANNEL',
])
@pytest.mark.parametrize('dtype', [np.float32, np.float64, np.float16])
def test_every_engine_gives_the_float64_array_engine(engine, body, dtype, monkeypatch):
    monkeypatch.setattr(lrn_host, 'BAND_BYTES', 64)          # the host in bands of 2 positions
    if dtype == np.float16 and not engine.on_device:
        pytest.skip('float16 LRN runs on GPUs')
    text = 'name: "n" type: "LRN" bottom: "x" top: "y" lrn_param { %s }' % body
    x = [randn(2, 7, 3, 5)]
    assert_matches(engine.run(text, x, dtype=dtype), reference(text, x), dtype, engine.name)


@pytest.mark.parametrize('body', [
    'local_size: 5 alpha: 0.5 beta: 0.75 k: 1.5',
    'local_size: 3 alpha: 0.3 beta: 0.6 norm_region: WITHIN_CHANNEL',
])
def test_lrn_gradient(host_engine, body):
    host_engine.check_gradient('name: "l" type: "LRN" bottom: "x" top: "y" lrn_param { %s }' % body,
                               [randn(2, 7, 3, 4)])


def test_lrn_across_channels_formula():
    x = randn(1, 4, 2, 2)
    _, _, top = forward('name: "l" type: "LRN" bottom: "x" top: "y" '
                         'lrn_param { local_size: 3 alpha: 0.6 beta: 0.75 k: 2 }', [x])
    scale = 2 + 0.2 * (x[0, 0] ** 2 + x[0, 1] ** 2)     # channel 0: window {0, 1} (zero pad)
    np.testing.assert_allclose(top[0].data[0, 0], x[0, 0] * scale ** -0.75)


def test_lrn_needs_odd_size():
    with pytest.raises(CaffeError, match='odd'):
        build_layer('name: "l" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 4 }',
                    [randn(1, 4, 2, 2)])
