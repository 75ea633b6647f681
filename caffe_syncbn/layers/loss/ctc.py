"""caffe_ocr's CTC layers: WarpCTCLoss (the connectionist temporal classification loss of
Baidu's warp-ctc, which that fork links) and CTCGreedyDecoder (docs/fork-layers.md).

Activations are (T, N, C), unnormalized: the loss takes their softmax over C itself.
The loss of an item is -log p(labels | x), the sum over every path of T classes that
collapses (repeats merged, blanks dropped) to its labels, computed by the
forward-backward recursions in log space in float64; the layer's loss is the mean over
the items whose cost is finite. An item whose labels need more steps than it has (its
labels plus its repeated neighbours) costs 0 and gets no gradient, as in warp-ctc.

The gradient is the exact gradient of that mean, times the loss weight. The fork writes
warp-ctc's gradient of the sum of the items' costs in its forward and leaves it there: N
times this one at loss weight 1, and deaf to the loss weight.
"""
import numpy as np

from ...backend import to_numpy
from ...layer import Layer, register
from .layers import VALID, LossLayer


def _logsumexp(*terms):
    stacked = np.stack(np.broadcast_arrays(*terms))
    top = stacked.max(axis=0)
    finite = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide='ignore'):
        return finite + np.log(np.exp(stacked - finite).sum(axis=0))


def _shift(values, by, fill=-np.inf):
    """``values`` moved ``by`` places to the right (left when negative), ``fill`` where
    nothing came in."""
    moved = np.full_like(values, fill)
    if by > 0:
        moved[by:] = values[:-by]
    else:
        moved[:by] = values[-by:]
    return moved


def ctc_cost_and_grad(activations, labels, blank):
    """(-log p(labels | activations), its gradient) for one item: ``activations`` (T, C)
    before the softmax, ``labels`` a list of class indices without blanks."""
    steps = len(activations)
    if steps == 0 or len(labels) + sum(a == b for a, b in zip(labels, labels[1:])) > steps:
        return 0.0, np.zeros_like(activations)
    shifted = activations - activations.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    extended = np.full(2 * len(labels) + 1, blank)
    extended[1::2] = labels
    emit = log_probs[:, extended]                               # (T, S)
    # a step may skip the blank between two different labels
    skip = np.zeros(len(extended), bool)
    skip[2:] = (extended[2:] != blank) & (extended[2:] != extended[:-2])
    alpha = np.full(emit.shape, -np.inf)
    beta = np.full(emit.shape, -np.inf)
    alpha[0, :2] = emit[0, :2]
    beta[-1, -2:] = emit[-1, -2:]
    for t in range(1, steps):
        previous = alpha[t - 1]
        alpha[t] = _logsumexp(previous, _shift(previous, 1),
                              np.where(skip, _shift(previous, 2), -np.inf)) + emit[t]
    skip_back = _shift(skip, -2, False)          # whether s + 2 may be reached from s
    for t in range(steps - 2, -1, -1):
        following = beta[t + 1]
        beta[t] = _logsumexp(following, _shift(following, -1),
                             np.where(skip_back, _shift(following, -2), -np.inf)) + emit[t]
    log_likelihood = _logsumexp(*alpha[-1, -2:])
    if not np.isfinite(log_likelihood):
        return np.inf, np.zeros_like(activations)
    occupancy = np.full(activations.shape, -np.inf)
    through = alpha + beta - emit - log_likelihood              # log P(path at s at t | labels)
    for s, label in enumerate(extended):
        occupancy[:, label] = _logsumexp(occupancy[:, label], through[:, s])
    return -float(log_likelihood), np.exp(log_probs) - np.exp(occupancy)


@register('WarpCTCLoss')
class WarpCTCLossLayer(LossLayer):
    """Bottom 0 the activations (T, N, C); then, as caffe_ocr reads them:
      2 bottoms: labels (N, L), every value that is ``blank_index`` left out (padding),
                 T steps per item;
      3 bottoms: continuation indicators (T, N), whose first 0 after step 0 ends an item's
                 steps, and labels (T, N) ended by a negative value, one added to each
                 when ``blank_index`` is 0;
      4 bottoms: steps per item (N), labels per item (N), labels (L, N).
    Labels are read as the fork reads them (the 3-bottom form rounds, the others
    truncate). Only ``ctc_loss_param.blank_index`` is read, as in the fork."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=2, maximum=4)
        self.check_tops(top, exact=1)
        self.blank = self.param.ctc_loss_param.blank_index

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) < 3 or bottom[0].count_range(3) != 1:
            raise self.error('activations (bottom 0) must be (T, N, C), got %s' % (shape,))
        steps, num, classes = shape[:3]
        if not 0 <= self.blank < classes:
            raise self.error('ctc_loss_param.blank_index %d is not one of the %d classes'
                             % (self.blank, classes))
        expected = {2: [(num, None)], 3: [(steps, num), (steps, num)],
                    4: [(num,), (num,), (None, num)]}[len(bottom)]
        for index, (blob, want) in enumerate(zip(bottom[1:], expected), 1):
            got = blob.shape if len(want) > 1 else (blob.count,)
            if len(got) < len(want) or any(w is not None and w != g
                                           for w, g in zip(want, got)):
                raise self.error('bottom %d must be (%s) (T=%d, N=%d), got shape %s'
                                 % (index, ', '.join('L' if w is None else str(w) for w in want),
                                    steps, num, blob.shape))
        top[0].reshape(())

    def sequences(self, bottom):
        """Per item: (its steps, its labels)."""
        steps, num = bottom[0].shape[:2]
        given = [to_numpy(b.data) for b in bottom[1:]]
        items = []
        if len(bottom) == 2:
            labels = given[0].reshape(num, -1).astype(np.int64)
            for row in labels:
                items.append((steps, [int(v) for v in row if v != self.blank]))
        elif len(bottom) == 3:
            indicators, labels = (g.reshape(steps, num) for g in given)
            offset = 1 if self.blank == 0 else 0
            for n in range(num):
                ends = np.flatnonzero(np.trunc(indicators[1:, n] + 0.5) == 0)
                length = int(ends[0]) + 1 if len(ends) else steps
                stop = np.flatnonzero(labels[:, n] < 0)
                row = labels[:stop[0] if len(stop) else steps, n]
                if len(row) == 0:
                    length = 0
                if len(row) > length:
                    raise self.error('item %d has %d labels for %d steps' % (n, len(row), length))
                items.append((length, [int(v + 0.5) + offset for v in row]))
        else:
            lengths, counts = given[0].reshape(-1), given[1].reshape(-1)
            labels = given[2].reshape(-1, num)
            for n in range(num):
                if not 0 <= lengths[n] <= steps or not 0 <= counts[n] <= len(labels):
                    raise self.error('item %d: %g steps and %g labels, out of (T=%d, L=%d)'
                                     % (n, lengths[n], counts[n], steps, len(labels)))
                items.append((int(lengths[n]), [int(v) for v in labels[:int(counts[n]), n]]))
        classes = bottom[0].shape[2]
        for n, (_, labels) in enumerate(items):
            if any(not 0 <= v < classes or v == self.blank for v in labels):
                raise self.error('item %d has labels %s: each must be a class in [0, %d) other '
                                 'than the blank %d' % (n, labels, classes, self.blank))
        return items

    def forward(self, bottom, top):
        activations = to_numpy(bottom[0].data).astype(np.float64)
        costs = np.zeros(activations.shape[1])
        self.grad = np.zeros(activations.shape)
        for n, (length, labels) in enumerate(self.sequences(bottom)):
            costs[n], self.grad[:length, n] = ctc_cost_and_grad(activations[:length, n],
                                                                labels, self.blank)
        finite = np.isfinite(costs)
        self.grad[:, ~finite] = 0
        self.set_loss(top, costs[finite].sum(),
                      self.normalizer(VALID, len(costs), len(costs), finite))

    def backward(self, top, propagate_down, bottom):
        for index in range(1, len(bottom)):
            self.refuse_label_gradient(propagate_down, index)
        if propagate_down[0]:
            scale = float(to_numpy(self.grad_scale(top)))
            bottom[0].diff[...] = self.xp.asarray(
                (self.grad * scale).astype(self.dtype).reshape(bottom[0].shape))

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0


@register('CTCGreedyDecoder')
class CTCGreedyDecoderLayer(Layer):
    """Best path decoding of (T, N, C) scores: the best class at each step (the first of
    equal ones), repeats merged (``ctc_merge_repeated``), blanks dropped. With one
    bottom, top (N, T, 1, 1): each item's classes, then -1. With labels (N, L) as bottom 1
    (negative ends a row, the blank is skipped), top (1, 2, 1, 1): one minus the mean of
    the edit distances over the longer sequence's length, and the share of exact
    matches, as the fork's accuracy."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=1, maximum=2)
        self.check_tops(top, exact=1)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) < 3 or bottom[0].count_range(3) != 1:
            raise self.error('scores (bottom 0) must be (T, N, C), got %s' % (shape,))
        if len(bottom) > 1 and bottom[1].shape[:1] != shape[1:2]:
            raise self.error('labels (bottom 1) must be (N=%d, L), got %s'
                             % (shape[1], bottom[1].shape))
        blank = self.param.ctc_decoder_param.blank_index
        self.blank = blank if blank >= 0 else shape[2] - 1
        top[0].reshape((1, 2, 1, 1) if len(bottom) > 1 else (shape[1], shape[0], 1, 1))

    def decode(self, scores):
        best = np.argmax(scores.reshape(scores.shape[0], scores.shape[1], -1), axis=2)
        sequences = []
        for column in best.T:
            keep = column != self.blank
            if self.param.ctc_decoder_param.ctc_merge_repeated:
                keep[1:] &= column[1:] != column[:-1]
            sequences.append(column[keep].tolist())
        return sequences

    def forward(self, bottom, top):
        sequences = self.decode(to_numpy(bottom[0].data))
        if len(bottom) == 1:
            out = np.full(top[0].shape[:2], -1.0)
            for n, sequence in enumerate(sequences):
                out[n, :len(sequence)] = sequence
        else:
            out = self.accuracy(sequences, to_numpy(bottom[1].data).reshape(len(sequences), -1))
        top[0].data[...] = self.xp.asarray(out.reshape(top[0].shape).astype(self.dtype))

    def accuracy(self, sequences, labels):
        distance, exact = 0.0, 0
        for sequence, row in zip(sequences, labels):
            stop = np.flatnonzero(row < 0)
            target = [int(v + 0.5) for v in row[:stop[0] if len(stop) else len(row)]]
            target = [v for v in target if v != self.blank]
            if not target and not sequence:
                continue        # as the fork: no edits, yet not an exact match
            edits = edit_distance(target, sequence)
            distance += edits / max(len(target), len(sequence))
            exact += edits == 0
        return np.array([1 - distance / len(sequences), exact / len(sequences)])

    def backward(self, top, propagate_down, bottom):
        pass                     # a decoder: no gradient (the fork's writes none either)


def edit_distance(first, second):
    """Levenshtein distance of two sequences."""
    row = list(range(len(second) + 1))
    for i, a in enumerate(first, 1):
        previous, row[0] = row[0], i
        for j, b in enumerate(second, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (a != b))
    return row[-1]
