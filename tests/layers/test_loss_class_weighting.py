"""SegNet's and ENet's class-weighted SoftmaxWithLoss (loss_param weight_by_label_freqs,
class_weighting) against a loop written from their softmax_loss_layer.cpp, finite
differences, and the plain loss where the flag is off."""
import numpy as np
import pytest

from caffe_syncbn.errors import CaffeError
from caffe_syncbn.testing import build_layer, check_gradient

WEIGHTS = [0.5, 2.0, 4.0]
TEXT = ('name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss" '
        'loss_param { %s ignore_label: 11 %s }')
WEIGHTED = 'weight_by_label_freqs: true ' + ' '.join('class_weighting: %g' % w for w in WEIGHTS)


def sample(seed=0):
    rs = np.random.RandomState(seed)
    scores = rs.standard_normal((2, 3, 4, 5)) * 2
    labels = rs.randint(0, 3, (2, 1, 4, 5)).astype(np.float64)
    labels[0, 0, 0, :3] = 11
    return scores, labels


def fork_loss(scores, labels, weights, normalize=True):
    """softmax_loss_layer.cpp's Forward_cpu: weighted -log p, over the count or over N."""
    prob = np.exp(scores - scores.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    loss, count = 0.0, 0
    n, _, height, width = scores.shape
    for i in range(n):
        for h in range(height):
            for w in range(width):
                label = int(labels[i, 0, h, w])
                if label == 11:
                    continue
                p = max(prob[i, label, h, w], np.finfo(np.float32).tiny)
                loss -= np.log(p) * weights[label]
                count += 1
    return loss / count if normalize else loss / n


@pytest.mark.parametrize('normalize', [True, False])
def test_the_forks_loss(normalize):
    scores, labels = sample()
    extra = '' if normalize else 'normalize: false'
    layer, bottom, top = build_layer(TEXT % (WEIGHTED, extra), [scores, labels])
    layer.forward(bottom, top)
    assert float(top[0].data) == pytest.approx(fork_loss(scores, labels, WEIGHTS, normalize),
                                               rel=1e-12)


def test_the_gradient_is_the_true_one():
    scores, labels = sample(1)
    assert check_gradient(TEXT % (WEIGHTED, ''), [scores, labels], check_bottom=[0]) < 1e-6


def test_without_the_flag_the_weights_are_ignored_as_the_forks_ignore_them():
    scores, labels = sample(2)
    plain, b, t = build_layer(TEXT % ('class_weighting: 3 class_weighting: 1 class_weighting: 1',
                                      ''), [scores, labels])
    plain.forward(b, t)
    assert float(t[0].data) == pytest.approx(fork_loss(scores, labels, [1, 1, 1]), rel=1e-6)


def test_one_weight_per_class():
    scores, labels = sample()
    with pytest.raises(CaffeError) as info:
        build_layer(TEXT % ('weight_by_label_freqs: true class_weighting: 1', ''),
                    [scores, labels])
    assert str(info.value) == ("layer 'loss' (type SoftmaxWithLoss): weight_by_label_freqs needs "
                               'one class_weighting per class: got 1 values for 3 classes')
