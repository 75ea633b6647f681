"""DeepLab's SegAccuracy against a loop written from seg_accuracy_layer.cpp and
confusion_matrix.cpp: per pixel the class of the highest (score, class) pair, a confusion
matrix over the pixels not ignored, and its accuracy, mean recall and mean Jaccard; on
every engine, with reset and without."""
import numpy as np
import pytest

from caffe_syncbn.errors import CaffeError
from caffe_syncbn.testing import build_layer

TEXT = ('name: "acc" type: "SegAccuracy" bottom: "score" bottom: "label" top: "acc" '
        'seg_accuracy_param { %s }')


def fork_matrix(scores, labels, ignored, matrix=None):
    """The confusion matrix of seg_accuracy_layer.cpp's Forward_cpu, one pixel at a time."""
    n, classes, height, width = scores.shape
    matrix = np.zeros((classes, classes)) if matrix is None else matrix.copy()
    for i in range(n):
        for h in range(height):
            for w in range(width):
                ranked = sorted(((scores[i, c, h, w], c) for c in range(classes)), reverse=True)
                truth = int(labels[i, 0, h, w])
                if truth in ignored:
                    continue
                matrix[truth, ranked[0][1]] += 1
    return matrix


def fork_scores(m):
    """ConfusionMatrix::accuracy, avgRecall(false) and avgJaccard."""
    total = m.sum()
    accuracy = np.trace(m) / total if total else 0.0
    recalls = [m[c, c] / m[c].sum() for c in range(len(m)) if m[c].sum() > 0]
    recall = sum(recalls) / len(recalls) if recalls else 0.0
    jaccard = []
    for c in range(len(m)):
        union = m[c].sum() + m[:, c].sum() - m[c, c]
        jaccard.append(1.0 if m[c, c] == union else m[c, c] / union)
    return [accuracy, recall, sum(jaccard) / len(m)]


def sample(seed, shape=(2, 5, 4, 6), ties=True):
    rs = np.random.RandomState(seed)
    scores = rs.randint(0, 4, shape).astype(np.float64)      # small integers: many ties
    if not ties:
        scores = rs.standard_normal(shape)
    labels = rs.randint(0, shape[1], (shape[0], 1) + shape[2:]).astype(np.float64)
    labels[rs.rand(*labels.shape) < 0.2] = 255
    return scores, labels


@pytest.mark.parametrize('ignore', ['ignore_label: 255', 'ignore_label: 255 ignore_label: 0'])
def test_the_fork_scores_on_every_engine(engine, ignore):
    scores, labels = sample(0)
    ignored = {255} | ({0} if 'ignore_label: 0' in ignore else set())
    layer, bottom, top = engine.build(TEXT % ignore, [scores, labels], dtype=np.float64)
    layer.forward(bottom, top)
    assert top[0].shape == (1, 1, 1, 3)
    want = fork_scores(fork_matrix(scores, labels, ignored))
    np.testing.assert_allclose(engine.host(top[0].data).ravel(), want, rtol=1e-12)


def test_without_reset_the_matrix_adds_up_over_forwards():
    first, labels = sample(1)
    second, labels2 = sample(2)
    layer, bottom, top = build_layer(TEXT % 'ignore_label: 255 reset: false', [first, labels])
    layer.forward(bottom, top)
    bottom[0].data[...], bottom[1].data[...] = second, labels2
    layer.forward(bottom, top)
    matrix = fork_matrix(second, labels2, {255}, fork_matrix(first, labels, {255}))
    np.testing.assert_allclose(top[0].data.ravel(), fork_scores(matrix), rtol=1e-12)
    layer, bottom, top = build_layer(TEXT % 'ignore_label: 255', [first, labels])
    layer.forward(bottom, top)
    bottom[0].data[...], bottom[1].data[...] = second, labels2
    layer.forward(bottom, top)                       # reset: the second batch alone
    np.testing.assert_allclose(top[0].data.ravel(),
                               fork_scores(fork_matrix(second, labels2, {255})), rtol=1e-12)


def test_an_unexpected_label_is_one_line():
    scores, labels = sample(3)
    labels[0, 0, 1, 1] = 7
    layer, bottom, top = build_layer(TEXT % 'ignore_label: 255', [scores, labels])
    with pytest.raises(CaffeError) as info:
        layer.forward(bottom, top)
    assert str(info.value) == ("layer 'acc' (type SegAccuracy): unexpected label 7 (classes 0 "
                               'to 4, ignored: [255])')


def test_labels_must_match_the_scores():
    with pytest.raises(CaffeError, match=r'labels must be N x 1 x H x W of scores N x C x H x W'):
        build_layer(TEXT % '', [np.zeros((2, 3, 4, 4)), np.zeros((2, 1, 4, 5))])
