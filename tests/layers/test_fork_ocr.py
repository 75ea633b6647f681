"""caffe_ocr's layers (docs/fork-layers.md): Transpose, Reverse and its Lstm against float64
loops written from the fork's source, finite differences, and the Lstm against BVLC's LSTM;
WarpCTCLoss against the sum over every alignment path (a brute-force reference, independent
of the forward-backward recursions) and finite differences; CTCGreedyDecoder against the
fork's loop and its accuracy; one-line errors."""
import itertools
import math

import numpy as np
import pytest

from caffe_syncbn.testing import build_layer, check_gradient
from helpers.messages import error_of, one_line

RS = np.random.RandomState(81)


def forward(text, bottoms, dtype=np.float64):
    layer, bottom, top = build_layer(text, bottoms, dtype=dtype)
    layer.forward(bottom, top)
    return layer, bottom, top


# ---- Transpose and Reverse -----------------------------------------------------------------
def transpose_loop(x, dims):
    """transpose_cpu: each index split by the bottom's strides, the top index from the
    axes that ``dims`` names."""
    shape = x.shape
    top_shape = [shape[d] for d in dims]
    from_counts = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
    to_counts = [int(np.prod(top_shape[i + 1:])) for i in range(len(shape))]
    out = np.zeros(x.size)
    for index, value in enumerate(x.reshape(-1)):
        rest, inds = index, []
        for count in from_counts:
            inds.append(rest // count)
            rest %= count
        out[sum(inds[dims[i]] * to_counts[i] for i in range(len(dims)))] = value
    return out.reshape(top_shape)


TRANSPOSE = 'name: "t" type: "Transpose" bottom: "x" top: "y" transpose_param { %s }'


@pytest.mark.parametrize('shape, dims', [
    ((2, 3, 4, 5), (3, 2, 0, 1)), ((3, 4), (1, 0)), ((2, 1, 3), (0, 1, 2)),
    ((2, 3, 2, 2, 3), (4, 0, 3, 1, 2))])
def test_transpose_matches_the_forks_loop(shape, dims):
    x = RS.standard_normal(shape)
    text = TRANSPOSE % ' '.join('dim: %d' % d for d in dims)
    _, _, top = forward(text, [x])
    np.testing.assert_array_equal(top[0].data, transpose_loop(x, dims))
    check_gradient(text, [x])


def reverse_loop(x, axis):
    """ReverseLayer::Forward_cpu: blocks of count(axis + 1) copied in reverse order."""
    count = x.size
    copy = 1 if axis + 1 == x.ndim else int(np.prod(x.shape[axis + 1:]))
    fixed = count // int(np.prod(x.shape[axis:])) if axis > 0 else 1
    steps = x.shape[axis]
    src, out = x.reshape(-1), np.zeros(count)
    s = 0
    for fix in range(fixed):
        target = (fix + 1) * copy * steps - copy
        for _ in range(steps):
            out[target:target + copy] = src[s:s + copy]
            s += copy
            target -= copy
    return out.reshape(x.shape)


@pytest.mark.parametrize('shape, axis', [((5, 2, 3), 0), ((2, 3, 4, 5), 2), ((3, 4), 1)])
def test_reverse_matches_the_forks_loop(shape, axis):
    x = RS.standard_normal(shape)
    text = 'name: "r" type: "Reverse" bottom: "x" top: "y" reverse_param { axis: %d }' % axis
    _, _, top = forward(text, [x])
    np.testing.assert_array_equal(top[0].data, reverse_loop(x, axis))
    check_gradient(text, [x])


@pytest.mark.parametrize('text, shape, message', [
    (TRANSPOSE % 'dim: 0 dim: 0 dim: 1', (2, 3, 4),
     "transpose_param must list each of the bottom's 3 axes once, got dim [0, 0, 1]"),
    (TRANSPOSE % 'dim: 1 dim: 0', (2, 3, 4), "bottom's 3 axes once, got dim [1, 0]"),
    ('name: "t" type: "Reverse" bottom: "x" top: "y" reverse_param { axis: -1 }', (2, 3),
     'reverse_param.axis must be >= 0, got -1'),
    ('name: "t" type: "Reverse" bottom: "x" top: "y" reverse_param { axis: 2 }', (2, 3),
     'axis 2 is out of range for a bottom of shape (2, 3)'),
])
def test_shape_layers_bad_input_is_one_line(text, shape, message):
    one_line(error_of(forward, text, [RS.standard_normal(shape)]), "layer 't'", message)


# ---- Lstm ----------------------------------------------------------------------------------
def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def lstm_loop(x, w_i, w_h, b, clip=None, h0=None, c0=None):
    """LstmLayer::Forward_cpu element by element: gates i, f, o, g; without a clip bottom
    cont is t > 0, with one the fork reads clip[t + n] (right for N = 1)."""
    steps, num, _ = x.shape
    hidden = w_h.shape[1]
    h_prev = np.zeros((num, hidden)) if h0 is None else h0
    c_prev = np.zeros((num, hidden)) if c0 is None else c0
    out, cells, gates = np.zeros((steps, num, hidden)), np.zeros((steps, num, hidden)), []
    for t in range(steps):
        pre = x[t] @ w_i.T + b
        h_to_gate = h_prev @ w_h.T
        gate_t = np.zeros((num, 4 * hidden))
        for n in range(num):
            cont = bool(clip[t + n]) if clip is not None else t > 0
            if cont:
                pre[n] += h_to_gate[n]
            for d in range(hidden):
                gate_t[n, d] = sigmoid(pre[n, d])
                gate_t[n, hidden + d] = sigmoid(pre[n, hidden + d]) if cont else 0.0
                gate_t[n, 2 * hidden + d] = sigmoid(pre[n, 2 * hidden + d])
                gate_t[n, 3 * hidden + d] = np.tanh(pre[n, 3 * hidden + d])
                cells[t, n, d] = (gate_t[n, hidden + d] * c_prev[n, d]
                                  + gate_t[n, d] * gate_t[n, 3 * hidden + d])
                out[t, n, d] = gate_t[n, 2 * hidden + d] * np.tanh(cells[t, n, d])
        gates.append(gate_t)
        h_prev, c_prev = out[t], cells[t]
    return out, cells, np.array(gates)


def lstm_fork_weight_h_gradient(x, out, cells, gates, w_h, dtop, clip, clipping=0.0):
    """The fork's Backward_cpu up to W_h's gradient: sum over t >= 1 of
    pre_gate_diff[t]^T h[t-1], whatever the continuation says (h_0 = 0 here)."""
    steps, num, hidden = out.shape
    dh = dtop.copy()
    dcell = np.zeros_like(cells)
    pre_diff = np.zeros((steps, num, 4 * hidden))
    for t in reversed(range(steps)):
        for n in range(num):
            cont = bool(clip[t + n]) if clip is not None else t > 0
            g = gates[t, n]
            c_prev = cells[t - 1, n] if t > 0 else np.zeros(hidden)
            tanh_c = np.tanh(cells[t, n])
            dcell[t, n] += dh[t, n] * g[2 * hidden:3 * hidden] * (1 - tanh_c ** 2)
            if t > 0:
                dcell[t - 1, n] = dcell[t, n] * g[hidden:2 * hidden] if cont else 0
            diff = np.concatenate([dcell[t, n] * g[3 * hidden:],
                                   dcell[t, n] * c_prev if cont else np.zeros(hidden),
                                   dh[t, n] * tanh_c, dcell[t, n] * g[:hidden]])
            act = np.concatenate([g[:3 * hidden] * (1 - g[:3 * hidden]), 1 - g[3 * hidden:] ** 2])
            pre_diff[t, n] = diff * act
            if clipping > 0:
                pre_diff[t, n] = np.clip(pre_diff[t, n], -clipping, clipping)
        if t > 0:
            for n in range(num):
                cont = bool(clip[t + n]) if clip is not None else t > 0
                if cont:
                    dh[t - 1, n] += pre_diff[t, n] @ w_h
    return sum(pre_diff[t].T @ out[t - 1] for t in range(1, steps))


LSTM = ('name: "lstm" type: "Lstm" bottom: "x" %s top: "y" lstm_param { num_output: %d %s '
        'weight_filler { type: "uniform" min: -0.5 max: 0.5 } '
        'bias_filler { type: "uniform" min: -0.5 max: 0.5 } }')


def test_lstm_forward_matches_the_forks_loop_and_blobs_keep_its_order():
    x = RS.standard_normal((5, 3, 4))
    layer, _, top = forward(LSTM % ('', 6, ''), [x])
    assert [b.shape for b in layer.blobs] == [(24, 4), (24, 6), (24,)]
    expected, _, _ = lstm_loop(x, *(b.data for b in layer.blobs))
    np.testing.assert_allclose(top[0].data, expected, rtol=1e-12, atol=1e-14)


def test_lstm_with_a_clip_bottom_carries_the_state_between_forwards():
    """N = 1, where the fork's clip[t + n] is the indicator of item n at step t."""
    x = RS.standard_normal((4, 1, 3))
    clip = np.array([[0.0], [1.0], [0.0], [1.0]])
    layer, bottom, top = forward(LSTM % ('bottom: "c"', 5, ''), [x, clip])
    w_i, w_h, b = (blob.data for blob in layer.blobs)
    first, cells, _ = lstm_loop(x, w_i, w_h, b, clip.reshape(-1))
    np.testing.assert_allclose(top[0].data, first, rtol=1e-12)
    bottom[1].data[...] = 1.0                    # continue from the last forward's state
    layer.forward(bottom, top)
    second, _, _ = lstm_loop(x, w_i, w_h, b, np.ones(4), first[-1], cells[-1])
    np.testing.assert_allclose(top[0].data, second, rtol=1e-12)


def test_lstm_is_bvlcs_lstm_with_its_blobs_reordered():
    x = RS.standard_normal((4, 2, 3))
    ocr, _, ocr_top = forward(LSTM % ('', 5, ''), [x])
    cont = np.ones((4, 2))
    cont[0] = 0
    bvlc_text = ('name: "l" type: "LSTM" bottom: "x" bottom: "cont" top: "y" '
                 'recurrent_param { num_output: 5 }')
    bvlc, bvlc_bottom, bvlc_top = build_layer(bvlc_text, [x, cont])
    w_i, w_h, b = (blob.data for blob in ocr.blobs)
    for blob, value in zip(bvlc.blobs, (w_i, b, w_h)):
        blob.data[...] = value
    bvlc.forward(bvlc_bottom, bvlc_top)
    np.testing.assert_allclose(ocr_top[0].data, bvlc_top[0].data, rtol=1e-12)


@pytest.mark.parametrize('with_clip', [False, True])
def test_lstm_gradient_matches_finite_differences(with_clip):
    x = RS.standard_normal((4, 2, 3))
    if with_clip:                  # a sequence restarting mid-way (the state is not carried)
        clip = np.array([[0, 0], [1, 1], [0, 1], [1, 1]], np.float64)
        check_gradient(LSTM % ('bottom: "c"', 4, ''), [x, clip], check_bottom=[0])
    else:
        check_gradient(LSTM % ('', 4, ''), [x])


def test_lstm_weight_gradient_where_the_fork_departs():
    """Without a clip bottom our W_h gradient is the fork's; with a 0 in the clip bottom
    after step 0 the fork adds a W_h term no forward used, and finite differences side
    with ours. N = 1, where the fork reads its clip bottom right."""
    x = RS.standard_normal((5, 1, 3))
    for clip, same in ((None, True), (np.array([0.0, 1.0, 0.0, 1.0, 1.0]), False)):
        text = LSTM % ('bottom: "c"' if clip is not None else '', 4, '')
        bottoms = [x] + ([clip.reshape(5, 1)] if clip is not None else [])
        layer, bottom, top = forward(text, bottoms)
        dtop = RS.standard_normal(top[0].shape)
        top[0].diff[...] = dtop
        layer.backward(top, [True] + [False] * (len(bottoms) - 1), bottom)
        w_i, w_h, b = (blob.data for blob in layer.blobs)
        out, cells, gates = lstm_loop(x, w_i, w_h, b, clip)
        fork = lstm_fork_weight_h_gradient(x, out, cells, gates, w_h, dtop, clip)
        assert np.allclose(layer.blobs[1].diff, fork, rtol=1e-10, atol=1e-12) == same
    check_gradient(LSTM % ('bottom: "c"', 4, ''), [x, clip.reshape(5, 1)], check_bottom=[0])


def test_lstm_clipping_threshold_clips_the_gate_gradients_as_the_fork():
    x = 3 * RS.standard_normal((4, 2, 3))
    layer, bottom, top = forward(LSTM % ('', 4, 'clipping_threshold: 0.01'), [x])
    dtop = RS.standard_normal(top[0].shape)
    top[0].diff[...] = dtop
    layer.backward(top, [True], bottom)
    w_i, w_h, b = (blob.data for blob in layer.blobs)
    out, cells, gates = lstm_loop(x, w_i, w_h, b)
    fork = lstm_fork_weight_h_gradient(x, out, cells, gates, w_h, dtop, None,
                                       clipping=float(np.float32(0.01)))
    np.testing.assert_allclose(layer.blobs[1].diff, fork, rtol=1e-10, atol=1e-12)
    unclipped = lstm_fork_weight_h_gradient(x, out, cells, gates, w_h, dtop, None)
    assert not np.allclose(fork, unclipped)


# ---- WarpCTCLoss ---------------------------------------------------------------------------
def collapse(path, blank):
    return [k for i, k in enumerate(path) if k != blank and (i == 0 or k != path[i - 1])]


def brute_force_ctc(activations, labels, blank):
    """-log of the sum, over every path of T classes that collapses to ``labels``, of the
    product of its softmax probabilities."""
    prob = np.exp(activations - activations.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    steps, classes = activations.shape
    total = sum(math.prod(prob[t, k] for t, k in enumerate(path))
                for path in itertools.product(range(classes), repeat=steps)
                if collapse(path, blank) == list(labels))
    return -math.log(total)


CTC = 'name: "ctc" type: "WarpCTCLoss" %s top: "loss" %s'


@pytest.mark.parametrize('blank, labels', [
    (0, [[1, 2, 0], [3, 3, 0]]),          # padding with the blank; a repeated label
    (0, [[2, 0, 0], [0, 0, 0]]),          # an empty sequence
    (3, [[1, 0, 3], [2, 1, 0]]),          # the last class as the blank
])
def test_ctc_loss_is_the_mean_over_every_alignment(blank, labels):
    x = RS.standard_normal((5, 2, 4))
    text = CTC % ('bottom: "x" bottom: "l"', 'ctc_loss_param { blank_index: %d }' % blank)
    _, _, top = forward(text, [x, np.array(labels, np.float64)])
    expected = np.mean([brute_force_ctc(x[:, n], [v for v in row if v != blank], blank)
                        for n, row in enumerate(labels)])
    np.testing.assert_allclose(float(top[0].data), expected, rtol=1e-12)
    check_gradient(text, [x, np.array(labels, np.float64)], check_bottom=[0])


def test_ctc_gradient_follows_the_loss_weight():
    """The fork leaves warp-ctc's gradient of the batch's sum in the bottom's diff, N times
    this one and blind to the loss weight; here it is the mean's, times the weight."""
    x = RS.standard_normal((4, 3, 5))
    labels = np.array([[1, 2], [3, 0], [4, 4]], np.float64)
    layer, bottom, top = forward(CTC % ('bottom: "x" bottom: "l"', ''), [x, labels])
    grads = []
    for weight in (1.0, 2.5):
        top[0].diff[...] = weight
        layer.backward(top, [True, False], bottom)
        grads.append(bottom[0].diff.copy())
    np.testing.assert_allclose(grads[1], 2.5 * grads[0], rtol=1e-12)
    # each item's slice sums to 0 over the classes (softmax minus a distribution)
    np.testing.assert_allclose(grads[0].sum(axis=2), 0, atol=1e-12)


def test_ctc_three_and_four_bottom_forms_read_lengths_as_the_fork():
    steps, num = 6, 2
    x = RS.standard_normal((steps, num, 4))
    # item 0: 4 steps, labels 0, 2 (the 3-bottom form adds 1 with blank 0); item 1: 6, [2]
    indicators = np.ones((steps, num))
    indicators[0] = 0
    indicators[4, 0] = 0
    time_labels = np.full((steps, num), -1.0)
    time_labels[:2, 0] = [0, 2]
    time_labels[0, 1] = 1
    _, _, three = forward(CTC % ('bottom: "x" bottom: "s" bottom: "l"', ''),
                          [x, indicators, time_labels])
    lengths, counts = np.array([4.0, 6.0]), np.array([2.0, 1.0])
    labels = np.array([[1, 2], [3, 0]], np.float64)        # (L, N)
    _, _, four = forward(CTC % ('bottom: "x" bottom: "s" bottom: "c" bottom: "l"', ''),
                         [x, lengths, counts, labels])
    expected = (brute_force_ctc(x[:4, 0], [1, 3], 0) + brute_force_ctc(x[:, 1], [2], 0)) / 2
    np.testing.assert_allclose(float(three[0].data), expected, rtol=1e-12)
    np.testing.assert_allclose(float(four[0].data), expected, rtol=1e-12)


def test_ctc_item_with_too_few_steps_costs_nothing():
    """warp-ctc: labels plus their repeats longer than the steps give cost 0, no gradient;
    the mean still counts the item."""
    x = RS.standard_normal((3, 2, 4))
    labels = np.array([[1, 1, 2], [2, 0, 0]], np.float64)   # 1 1 2 needs 4 steps
    layer, bottom, top = forward(CTC % ('bottom: "x" bottom: "l"', ''), [x, labels])
    np.testing.assert_allclose(float(top[0].data), brute_force_ctc(x[:, 1], [2], 0) / 2,
                               rtol=1e-12)
    top[0].diff[...] = 1
    layer.backward(top, [True, False], bottom)
    assert not bottom[0].diff[:, 0].any() and bottom[0].diff[:, 1].any()


@pytest.mark.parametrize('bottoms, settings, message', [
    ([(4, 2, 3), (2, 2)], 'ctc_loss_param { blank_index: 3 }',
     'ctc_loss_param.blank_index 3 is not one of the 3 classes'),
    ([(4, 2, 3), (3, 2)], '', 'bottom 1 must be (2, L) (T=4, N=2), got shape (3, 2)'),
    ([(4, 2), (2, 2)], '', 'activations (bottom 0) must be (T, N, C), got (4, 2)'),
    ([(4, 2, 3), (2, 2)], 'LABELS 5', 'item 0 has labels [5, 5]: each must be a class in '
                                      '[0, 3) other than the blank 0'),
])
def test_ctc_bad_input_is_one_line(bottoms, settings, message):
    arrays = [RS.standard_normal(shape) for shape in bottoms]
    if settings.startswith('LABELS'):
        arrays[1][...] = float(settings.split()[1])
        settings = ''
    else:
        arrays[1] = np.ones(bottoms[1])
    names = ' '.join('bottom: "b%d"' % i for i in range(len(arrays)))
    one_line(error_of(forward, CTC % (names, settings), arrays), "layer 'ctc'", message)


# ---- CTCGreedyDecoder ----------------------------------------------------------------------
def greedy_loop(scores, blank, merge):
    """CTCGreedyDecoderLayer::Decode: the first maximum, blanks dropped, repeats merged."""
    steps, num, classes = scores.shape
    sequences = []
    for n in range(num):
        previous, sequence = -1, []
        for t in range(steps):
            best = 0
            for c in range(1, classes):
                if scores[t, n, c] > scores[t, n, best]:
                    best = c
            if best != blank and not (merge and best == previous):
                sequence.append(best)
            previous = best
        sequences.append(sequence)
    return sequences


DECODER = 'name: "dec" type: "CTCGreedyDecoder" bottom: "x" %s top: "y" %s'


@pytest.mark.parametrize('blank, merge', [(0, True), (-1, True), (2, False)])
def test_greedy_decoder_matches_the_forks_loop(blank, merge):
    x = np.round(RS.standard_normal((7, 3, 4)), 1)          # ties: the first maximum wins
    settings = 'ctc_decoder_param { blank_index: %d ctc_merge_repeated: %s }' % (
        blank, 'true' if merge else 'false')
    _, _, top = forward(DECODER % ('', settings), [x])
    sequences = greedy_loop(x, blank if blank >= 0 else 3, merge)
    expected = np.full((3, 7), -1.0)
    for n, sequence in enumerate(sequences):
        expected[n, :len(sequence)] = sequence
    assert top[0].shape == (3, 7, 1, 1)
    np.testing.assert_array_equal(top[0].data.reshape(3, 7), expected)


def test_greedy_decoder_accuracy_is_the_forks_edit_and_line_accuracy():
    scores = np.full((4, 3, 4), -5.0)
    for n, path in enumerate(([1, 1, 0, 2], [3, 0, 3, 0], [0, 0, 0, 0])):
        scores[np.arange(4), n, path] = 5.0        # decodes to [1, 2], [3, 3], []
    labels = np.array([[1, 2, -1], [3, 2, -1], [0, -1, -1]], np.float64)  # 0 is the blank
    _, _, top = forward(DECODER % ('bottom: "l"', ''), [scores, labels])
    # edit distances 0 (of 2) and 1 (of 2); the third has nothing on either side: skipped
    np.testing.assert_allclose(top[0].data.reshape(-1), [1 - 0.5 / 3, 1 / 3], rtol=1e-6)
