"""The PSPNet fork's Interp: the fork's golden outputs and every engine against the float64
array engine (the engine fixture), finite-difference gradients, aligned corners, the fork's
float32 bits in blocks, and one-line errors."""
import json

import numpy as np
import pytest

from caffe_syncbn.backend import cpu_threads
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layers.interp.array import interp_taps
from caffe_syncbn.testing import build_layer
from helpers.arrays import randn
from helpers.engines import assert_matches, reference
from helpers.golden_layer_case import run_single_layer_case
from helpers.layer_checks import forward
from helpers.paths import GOLDEN


def _psp_interp_cases():
    index = GOLDEN / 'psp_index.json'
    if not index.exists():
        return ['<no golden data>']
    return [c['name'] for c in json.loads(index.read_text())['cases']
            if c['kind'] == 'layer' and set(c['layer_types']) == {'Input', 'Interp'}]


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('case', _psp_interp_cases())
def test_golden_single_layer(case, dtype, engine, monkeypatch):
    run_single_layer_case(case, monkeypatch, dtype=dtype, engine=engine)


def _interp(body):
    return 'name: "r" type: "Interp" bottom: "x" top: "y" interp_param { %s }' % body


@pytest.mark.parametrize('body', ['height: 7 width: 5', 'zoom_factor: 2',
                                  'shrink_factor: 2 pad_beg: -1 pad_end: -1',
                                  'height: 1 width: 1', 'height: 4 width: 5'])     # a crop alone
@pytest.mark.parametrize('dtype', [np.float32, np.float64, np.float16])
def test_every_engine_gives_the_float64_array_engine(engine, body, dtype):
    if dtype == np.float16 and not engine.on_device:
        pytest.skip('float16 Interp runs on GPUs')
    text = _interp(body)
    x = [randn(2, 2, 4, 5, seed=3)]
    assert_matches(engine.run(text, x, dtype=dtype), reference(text, x), dtype, engine.name)


@pytest.mark.parametrize('body, shape, out', [
    ('zoom_factor: 3', (1, 2, 3, 4), (1, 2, 7, 10)),
    ('shrink_factor: 2', (1, 1, 5, 6), (1, 1, 3, 3)),
    ('shrink_factor: 2 zoom_factor: 3', (1, 1, 5, 6), (1, 1, 7, 7)),
    ('height: 5 width: 2 pad_beg: -1 pad_end: -1', (2, 1, 5, 6), (2, 1, 5, 2)),
    ('height: 1 width: 3', (1, 1, 3, 3), (1, 1, 1, 3)),
    ('height: 3 width: 4 pad_beg: -1', (1, 1, 4, 5), (1, 1, 3, 4)),
])
def test_interp_shapes_and_gradient(host_engine, body, shape, out):
    _, _, top = forward(_interp(body), [randn(*shape)])
    assert top[0].shape == out
    host_engine.check_gradient(_interp(body), [randn(*shape)])


def test_interp_aligns_corners():
    x = randn(1, 1, 3, 4)
    _, _, top = forward(_interp('zoom_factor: 4'), [x])
    y = top[0].data[0, 0]
    np.testing.assert_allclose(y[::4, ::4], x[0, 0])
    np.testing.assert_allclose(y[2, 2], x[0, 0, :2, :2].mean())


@pytest.mark.parametrize('body, message', [
    ('pad_beg: 1 zoom_factor: 2', '<= 0'),
    ('height: 4', 'height and width'),
    ('pad_beg: -2 pad_end: -2 zoom_factor: 2', 'nothing'),
])
def test_interp_errors(body, message):
    with pytest.raises(CaffeError, match=message):
        build_layer(_interp(body), [randn(1, 1, 4, 4)])


def test_interp_in_blocks_gives_the_forks_bits(monkeypatch):
    """Interp's forward in blocks of planes: bit for bit the fork's float32 arithmetic,
    w0 * a + w1 * b along W, then along H, over the whole array at once."""
    monkeypatch.setattr(cpu_threads, 'BLOCK_BYTES', 64)
    x = np.random.RandomState(5).standard_normal((2, 3, 6, 5)).astype(np.float32)
    layer, bottom, top = build_layer('name: "i" type: "Interp" bottom: "x" top: "y" '
                                     'interp_param { height: 11 width: 9 }', [x],
                                     dtype=np.float32)
    layer.forward(bottom, top)
    (hf, hs, hw), (wf, ws, ww) = interp_taps(6, 11), interp_taps(5, 9)
    along_w = (1 - ww) * x[:, :, :, wf] + ww * x[:, :, :, ws]
    expected = (1 - hw)[:, None] * along_w[:, :, hf] + hw[:, None] * along_w[:, :, hs]
    np.testing.assert_array_equal(top[0].data, expected)
