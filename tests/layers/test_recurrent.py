"""LSTMUnit, LSTM and RNN: golden cases, gradient checks, param layout and state handling."""
import numpy as np
import pytest

from caffe_syncbn import TEST, Net, caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.testing import build_layer, check_gradient
from helpers.golden_layer_case import run_single_layer_case, single_layer_cases

FILLERS = ('weight_filler { type: "uniform" min: -0.5 max: 0.5 } '
           'bias_filler { type: "uniform" min: -0.3 max: 0.3 }')


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('name', single_layer_cases(['LSTM', 'LSTMUnit', 'RNN']))
def test_golden(name, dtype, monkeypatch):
    run_single_layer_case(name, monkeypatch, dtype)


def recurrent_text(kind, hidden, static=False, expose=False):
    states = (['h0', 'c0'] if kind == 'LSTM' else ['h0']) if expose else []
    bottoms = ['x', 'cont'] + (['static'] if static else []) + states
    tops = ['out'] + [s.replace('0', 'T') for s in states]
    return ('name: "rec" type: "%s" %s %s recurrent_param { num_output: %d %s expose_hidden: %s }'
            % (kind, ' '.join('bottom: "%s"' % b for b in bottoms),
               ' '.join('top: "%s"' % t for t in tops), hidden, FILLERS, str(expose).lower()))


def sequence(rs, steps=4, num=3, dim=2, restart=True):
    x = rs.standard_normal((steps, num, dim))
    cont = np.ones((steps, num))
    cont[0] = 0                              # every stream starts a sequence at t = 0
    if restart:
        cont[2, 0] = 0
    return x, cont


def test_lstm_unit_gradient():
    rs = np.random.RandomState(0)
    text = ('name: "unit" type: "LSTMUnit" bottom: "c_prev" bottom: "x" bottom: "cont" '
            'top: "c" top: "h"')
    bottoms = [rs.standard_normal((1, 4, 3)), rs.standard_normal((1, 4, 12)),
               np.array([[1.0, 0.0, 1.0, 0.0]])]
    check_gradient(text, bottoms, check_bottom=[0, 1])


@pytest.mark.parametrize('kind', ['LSTM', 'RNN'])
@pytest.mark.parametrize('static', [False, True])
def test_recurrent_gradient(kind, static):
    rs = np.random.RandomState(1)
    x, cont = sequence(rs)
    bottoms = [x, cont] + ([rs.standard_normal((3, 2, 1))] if static else [])
    check_gradient(recurrent_text(kind, 3, static), bottoms,
                   check_bottom=[0, 2] if static else [0])


@pytest.mark.parametrize('kind', ['LSTM', 'RNN'])
def test_recurrent_gradient_exposed_states(kind):
    rs = np.random.RandomState(2)
    x, cont = sequence(rs)
    cont[0] = 1                              # continue from the given initial states
    states = [rs.standard_normal((1, 3, 3)) for _ in range(2 if kind == 'LSTM' else 1)]
    check_gradient(recurrent_text(kind, 3, expose=True), [x, cont] + states,
                   check_bottom=[0] + list(range(2, 2 + len(states))))


@pytest.mark.parametrize('kind,shapes', [
    ('LSTM', [(20, 6), (20,), (20, 4), (20, 5)]),
    ('RNN', [(5, 6), (5,), (5, 4), (5, 5), (5, 5), (5,)]),
])
def test_param_layout_matches_caffe(kind, shapes):
    rs = np.random.RandomState(3)
    x = rs.standard_normal((2, 3, 2, 3))                   # D = 6 values per step and item
    layer, _, _ = build_layer(recurrent_text(kind, 5, static=True),
                              [x, np.ones((2, 3)), np.zeros((3, 4))])
    assert [b.shape for b in layer.blobs] == shapes


def run(layer, bottom, top, *arrays):
    for blob, a in zip(bottom, arrays):
        blob.reshape(a.shape)
        blob.data[...] = a
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return [t.data.copy() for t in top]


@pytest.mark.parametrize('kind', ['LSTM', 'RNN'])
def test_state_carries_over_between_forwards(kind):
    """Without expose_hidden Caffe starts each forward from the last one's final state."""
    rs = np.random.RandomState(4)
    x, cont = sequence(rs, steps=6, restart=False)
    layer, bottom, top = build_layer(recurrent_text(kind, 3), [x, cont])
    (whole,) = run(layer, bottom, top, x, cont)
    weights = [b.data for b in layer.blobs]
    layer, bottom, top = build_layer(recurrent_text(kind, 3), [x, cont])
    for blob, w in zip(layer.blobs, weights):
        blob.data[...] = w
    (first,) = run(layer, bottom, top, x[:4], cont[:4])
    (second,) = run(layer, bottom, top, x[4:], cont[4:])
    np.testing.assert_allclose(np.concatenate([first, second]), whole, rtol=1e-12)


@pytest.mark.parametrize('kind', ['LSTM', 'RNN'])
def test_exposed_states_chain(kind):
    rs = np.random.RandomState(5)
    x, cont = sequence(rs, steps=5, restart=False)
    n_states = 2 if kind == 'LSTM' else 1
    zeros = [np.zeros((1, 3, 3))] * n_states
    layer, bottom, top = build_layer(recurrent_text(kind, 3, expose=True), [x, cont] + zeros)
    whole = run(layer, bottom, top, x, cont, *zeros)
    part1 = run(layer, bottom, top, x[:2], cont[:2], *zeros)
    part2 = run(layer, bottom, top, x[2:], cont[2:], *part1[1:])
    np.testing.assert_allclose(np.concatenate([part1[0], part2[0]]), whole[0], rtol=1e-12)
    for final, expected in zip(part2[1:], whole[1:]):
        np.testing.assert_allclose(final, expected, rtol=1e-12)
    if kind == 'LSTM':
        np.testing.assert_allclose(whole[1][0], whole[0][-1])      # h_T is the last output


def test_cont_zero_forgets_the_past():
    rs = np.random.RandomState(6)
    x, cont = sequence(rs, restart=True)
    layer, bottom, top = build_layer(recurrent_text('LSTM', 3), [x, cont])
    (whole,) = run(layer, bottom, top, x, cont)
    (tail,) = run(layer, bottom, top, x[2:, :1], cont[2:, :1])
    np.testing.assert_allclose(tail[:, 0], whole[2:, 0], rtol=1e-12)


def test_frozen_params_get_no_gradient():
    rs = np.random.RandomState(7)
    x, cont = sequence(rs)
    layer, bottom, top = build_layer(recurrent_text('RNN', 3), [x, cont])
    layer.param_propagate_down = [False, True, False, True, False]
    layer.forward(bottom, top)
    top[0].diff[...] = 1
    layer.backward(top, [True, False], bottom)
    assert [bool(b.diff.any()) for b in layer.blobs] == [False, True, False, True, False]
    assert not bottom[1].diff.any()


def test_shape_errors():
    rs = np.random.RandomState(8)
    x, cont = sequence(rs)
    with pytest.raises(CaffeError, match="layer 'rec'.*cont"):
        build_layer(recurrent_text('LSTM', 3), [x, cont[:, :2]])
    with pytest.raises(CaffeError, match='num_output'):
        build_layer(recurrent_text('RNN', 0), [x, cont])
    with pytest.raises(CaffeError, match='c_prev'):
        build_layer('name: "u" type: "LSTMUnit" bottom: "a" bottom: "b" bottom: "c" '
                    'top: "c" top: "h"', [np.zeros((1, 2, 3)), np.zeros((1, 2, 3)),
                                          np.zeros((1, 2))])


# ---- the CRNN ports' ContinuationIndicator ----------------------------------------------------
def indicator_param(time_step, batch_size):
    return ('name: "indicator" type: "ContinuationIndicator" top: "indicator" '
            'continuation_indicator_param { time_step: %d batch_size: %d }'
            % (time_step, batch_size))


def test_continuation_indicator_writes_the_forks_loop():
    """ContinuationIndicatorLayer::Forward_cpu: t == 0 ? 0 : 1, time-major."""
    layer, bottom, top = build_layer(indicator_param(5, 3), [])
    layer.forward(bottom, top)
    expected = [[0 if t == 0 else 1 for _ in range(3)] for t in range(5)]
    np.testing.assert_array_equal(top[0].data, expected)


def test_an_lstm_fed_by_the_indicator_is_the_lstm_fed_by_an_input_of_it():
    """crnn.caffe's pattern: the indicator as the LSTM's second bottom, against the same
    values given as an Input."""
    lstm = ('layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "%s" top: "h" '
            'recurrent_param { num_output: 4 weight_filler { type: "gaussian" std: 0.3 } '
            'bias_filler { type: "constant" value: 0.1 } } }')
    x = 'layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 6 dim: 2 dim: 3 } } }'
    cont = ('layer { name: "cont" type: "Input" top: "cont" '
            'input_param { shape { dim: 6 dim: 2 } } }')
    fed = Net(parse_text('\n'.join([x, 'layer { %s }' % indicator_param(6, 2), lstm % 'indicator']),
                         caffe_pb2.NetParameter()), TEST)
    given = Net(parse_text('\n'.join([x, cont, lstm % 'cont']), caffe_pb2.NetParameter()), TEST)
    for mine, theirs in zip(fed.params['lstm'], given.params['lstm']):
        theirs.data[...] = mine.data
    inputs = np.random.RandomState(0).standard_normal((6, 2, 3))
    markers = np.ones((6, 2))
    markers[0] = 0
    np.testing.assert_array_equal(fed.forward(x=inputs)['h'],
                                  given.forward(x=inputs, cont=markers)['h'])


@pytest.mark.parametrize('time_step, batch_size, field', [(0, 1, 'time_step'),
                                                           (4, 0, 'batch_size')])
def test_continuation_indicator_sizes_must_be_positive(time_step, batch_size, field):
    with pytest.raises(CaffeError, match='continuation_indicator_param.%s must be at least 1, '
                                         'got 0' % field):
        build_layer(indicator_param(time_step, batch_size), [])
