"""Loss layers and Accuracy: golden cases and SoftmaxWithLoss on every engine (the engine
fixture), gradient checks, normalizers, the data-parallel rule, one-line errors."""
import numpy as np
import pytest

from caffe_syncbn import caffe_pb2
from caffe_syncbn.blob import Blob
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layer import LayerContext, create_layer
from caffe_syncbn.testing import build_layer, layer_param
from helpers.engines import assert_matches, reference
from helpers.golden_layer_case import run_single_layer_case, single_layer_cases

LOSS_TYPES = ['SoftmaxWithLoss', 'SigmoidCrossEntropyLoss', 'EuclideanLoss', 'HingeLoss',
              'ContrastiveLoss', 'InfogainLoss', 'MultinomialLogisticLoss', 'Accuracy']


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('name', single_layer_cases(LOSS_TYPES))
def test_golden(name, dtype, engine, monkeypatch):
    run_single_layer_case(name, monkeypatch, dtype, engine=engine)


def layer_text(kind, extra='', bottoms=2, tops=1):
    names = ['b%d' % i for i in range(bottoms)]
    return ('name: "loss" type: "%s" %s %s %s' % (
        kind, ' '.join('bottom: "%s"' % b for b in names),
        ' '.join('top: "t%d"' % i for i in range(tops)), extra))


def scores_and_labels(rs, shape, classes_axis=1, ignore=None, ignore_fraction=0.3):
    scores = rs.standard_normal(shape)
    label_shape = shape[:classes_axis] + shape[classes_axis + 1:]
    labels = rs.randint(0, shape[classes_axis], label_shape).astype(float)
    if ignore is not None:
        labels[rs.uniform(size=label_shape) < ignore_fraction] = ignore
    return scores, labels


# ----------------------------------------------------------------------------- every engine

@pytest.mark.parametrize('extra', ['', 'loss_param { ignore_label: 2 }',
                                   'loss_param { ignore_label: 0 normalization: FULL }',
                                   'loss_param { normalization: BATCH_SIZE }',
                                   'softmax_param { axis: 2 }'])
@pytest.mark.parametrize('dtype', [np.float32, np.float64, np.float16])
def test_softmax_loss_on_every_engine_gives_the_float64_array_engine(engine, extra, dtype):
    if dtype == np.float16 and not engine.on_device:
        pytest.skip('float16 losses run on GPUs')
    rs = np.random.RandomState(2)
    scores = rs.standard_normal((2, 4, 3, 2)) * 3
    classes, label_shape = (3, (2, 4, 1, 2)) if 'axis: 2' in extra else (4, (2, 1, 3, 2))
    labels = rs.randint(0, classes, label_shape).astype(np.float64)
    text = layer_text('SoftmaxWithLoss', extra, tops=2)
    bottoms, down = [scores, labels], [True, False]
    assert_matches(engine.run(text, bottoms, propagate_down=down, dtype=dtype),
                   reference(text, bottoms, propagate_down=down), dtype, engine.name)


def test_labels_out_of_range_are_one_error_on_every_engine(engine):
    layer, bottom, top = engine.build(layer_text('SoftmaxWithLoss'),
                                      [np.zeros((2, 3)), np.array([1.0, 3.0])])
    with pytest.raises(CaffeError, match="layer 'loss'.*labels must lie in \\[0, 3\\).*got 3"):
        engine.forward(layer, bottom, top)


# ----------------------------------------------------------------------------- gradients

@pytest.mark.parametrize('norm', ['VALID', 'BATCH_SIZE', 'FULL', 'NONE'])
def test_softmax_loss_gradient(host_engine, norm):
    rs = np.random.RandomState(0)
    scores, labels = scores_and_labels(rs, (2, 3, 2, 3), ignore=5)
    text = layer_text('SoftmaxWithLoss', 'loss_param { ignore_label: 5 normalization: %s }'
                      % norm)
    host_engine.check_gradient(text, [scores, labels], check_bottom=[0])


def test_softmax_loss_gradient_axis_and_prob_top(host_engine):
    rs = np.random.RandomState(1)
    scores, labels = scores_and_labels(rs, (3, 2, 4), classes_axis=2)
    text = layer_text('SoftmaxWithLoss', 'softmax_param { axis: -1 }', tops=2)
    # Caffe ignores the prob top's diff, as its loss weight is 0
    host_engine.check_gradient(text, [scores, labels], check_bottom=[0],
                               top_weights=[np.array(1.7), np.zeros((3, 2, 4))])
    layer, bottom, top = build_layer(text, [scores, labels])
    layer.forward(bottom, top)
    e = np.exp(scores - scores.max(axis=2, keepdims=True))
    np.testing.assert_allclose(top[1].data, e / e.sum(axis=2, keepdims=True), rtol=1e-12)


@pytest.mark.parametrize('extra', ['', 'loss_param { ignore_label: -1 normalization: VALID }',
                                   'loss_param { normalization: FULL }'])
def test_sigmoid_cross_entropy_gradient(host_engine, extra):
    rs = np.random.RandomState(2)
    scores = rs.standard_normal((3, 4)) * 3
    targets = rs.uniform(size=(3, 4))
    if 'ignore' in extra:
        targets = (targets > 0.5).astype(float)
        targets[0, 1] = targets[2, 3] = -1
    host_engine.check_gradient(layer_text('SigmoidCrossEntropyLoss', extra), [scores, targets],
                               check_bottom=[0])


def test_euclidean_gradient(host_engine):
    rs = np.random.RandomState(3)
    host_engine.check_gradient(layer_text('EuclideanLoss'), [rs.standard_normal((3, 2, 2)),
                                                             rs.standard_normal((3, 4))])


@pytest.mark.parametrize('norm', ['L1', 'L2'])
def test_hinge_gradient(host_engine, norm):
    rs = np.random.RandomState(4)
    scores = rs.uniform(-3, 3, (4, 5))
    scores[np.abs(np.abs(scores) - 1) < 0.1] += 0.3       # keep away from the hinge's kink
    labels = rs.randint(0, 5, 4).astype(float)
    host_engine.check_gradient(layer_text('HingeLoss', 'hinge_loss_param { norm: %s }' % norm),
                               [scores, labels], check_bottom=[0])


@pytest.mark.parametrize('legacy', [False, True])
def test_contrastive_gradient(host_engine, legacy):
    rs = np.random.RandomState(5)
    a, b = rs.standard_normal((6, 3, 1, 1)) * 0.6, rs.standard_normal((6, 3, 1, 1)) * 0.6
    sim = np.array([1, 0, 0, 1, 0, 0], float).reshape(6, 1, 1, 1)
    text = layer_text('ContrastiveLoss', 'contrastive_loss_param { margin: 2.5 legacy_version: %s }'
                      % str(legacy).lower(), bottoms=3)
    # Caffe's non-legacy gradient divides by d + 1e-4 instead of d: close, not exact
    host_engine.check_gradient(text, [a, b, sim], check_bottom=[0, 1],
                               tolerance=1e-6 if legacy else 1e-3)


def test_multinomial_logistic_gradient(host_engine):
    rs = np.random.RandomState(6)
    prob = rs.uniform(0.1, 1, (5, 4))
    host_engine.check_gradient(layer_text('MultinomialLogisticLoss'),
                               [prob / prob.sum(axis=1, keepdims=True),
                                rs.randint(0, 4, 5).astype(float)], check_bottom=[0])


def write_infogain(path, matrix):
    proto = caffe_pb2.BlobProto()
    proto.shape.dim.extend(matrix.shape)
    proto.data.extend(matrix.ravel())
    path.write_bytes(proto.SerializeToString())


def test_infogain_gradient_from_bottom_and_file(host_engine, tmp_path, monkeypatch):
    rs = np.random.RandomState(7)
    scores, labels = scores_and_labels(rs, (2, 3, 4), ignore=9)
    H = rs.uniform(0, 1, (3, 3))
    host_engine.check_gradient(
        layer_text('InfogainLoss', 'loss_param { ignore_label: 9 }', bottoms=3),
        [scores, labels, H], check_bottom=[0])
    monkeypatch.chdir(tmp_path)
    write_infogain(tmp_path / 'H.binaryproto', H)
    from_file = layer_text('InfogainLoss', 'loss_param { ignore_label: 9 } '
                           'infogain_loss_param { source: "H.binaryproto" }')
    host_engine.check_gradient(from_file, [scores, labels], check_bottom=[0])
    plain = layer_text('SoftmaxWithLoss', 'loss_param { ignore_label: 9 }')
    b, bottom_b, top_b = build_layer(plain, [scores, labels])
    write_infogain(tmp_path / 'H.binaryproto', np.eye(3))
    a, bottom_a, top_a = build_layer(from_file, [scores, labels])
    a.forward(bottom_a, top_a)
    b.forward(bottom_b, top_b)
    np.testing.assert_allclose(top_a[0].data, top_b[0].data, rtol=1e-12)  # H = I: plain softmax


# ----------------------------------------------------------------------------- normalizers

def forward_loss(text, bottoms, comm=None):
    ctx = LayerContext(dtype=np.float64, comm=comm)
    layer = create_layer(layer_param(text), ctx)
    bottom = [Blob(np.shape(a), np.float64) for a in bottoms]
    for blob, a in zip(bottom, bottoms):
        blob.data[...] = a
    top = [Blob((), np.float64)]
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    top[0].diff[...] = 1
    layer.backward(top, [True] + [False] * (len(bottom) - 1), bottom)
    return float(top[0].data), bottom[0].diff.copy()


@pytest.mark.parametrize('norm,divisor', [('VALID', 'valid'), ('BATCH_SIZE', 2), ('FULL', 12),
                                          ('NONE', 1), ('<normalize true>', 'valid'),
                                          ('<normalize false>', 2)])
def test_softmax_normalizer(norm, divisor):
    rs = np.random.RandomState(8)
    scores, labels = scores_and_labels(rs, (2, 4, 2, 3), ignore=7, ignore_fraction=0.4)
    valid = labels != 7
    if norm.startswith('<'):
        extra = 'loss_param { ignore_label: 7 normalize: %s }' % norm.split()[1][:-1]
    else:
        extra = 'loss_param { ignore_label: 7 normalization: %s }' % norm
    loss, _ = forward_loss(layer_text('SoftmaxWithLoss', extra), [scores, labels])
    prob = np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)
    p_true = np.take_along_axis(prob, np.where(valid, labels, 0).astype(int)[:, None], 1)[:, 0]
    expected = -np.log(p_true)[valid].sum() / (valid.sum() if divisor == 'valid' else divisor)
    assert loss == pytest.approx(expected, rel=1e-12)


def test_sigmoid_cross_entropy_default_is_batch_size():
    scores, targets = np.zeros((4, 3)), np.full((4, 3), 0.5)
    loss, _ = forward_loss(layer_text('SigmoidCrossEntropyLoss'), [scores, targets])
    assert loss == pytest.approx(3 * np.log(2), rel=1e-12)      # 12 * log 2 / N=4


def test_valid_normalizer_is_at_least_one():
    scores, labels = np.zeros((2, 3)), np.full(2, 4.0)          # every label ignored
    loss, diff = forward_loss(layer_text('SoftmaxWithLoss', 'loss_param { ignore_label: 4 }'),
                              [scores, labels])
    assert loss == 0 and not diff.any()


class FakeComm:
    """Stands in for the Communicator: answers every allreduce with a preset global value."""

    def __init__(self, size, global_value):
        self.size, self.global_value, self.calls = size, global_value, []

    def allreduce_scalar(self, value, tag):
        self.calls.append((value, tag))
        return self.global_value


def test_normalizer_comes_from_the_communicator():
    scores, labels = np.zeros((3, 2)), np.array([0.0, 1.0, 5.0])   # 2 valid labels here
    text = layer_text('SoftmaxWithLoss', 'loss_param { ignore_label: 5 }')
    comm = FakeComm(size=4, global_value=16.0)
    loss, diff = forward_loss(text, [scores, labels], comm)
    assert [c[0] for c in comm.calls] == [2.0]
    assert loss == pytest.approx(2 * np.log(2) / (16.0 / 4), rel=1e-12)   # normalizer 16 / 4
    assert np.allclose(diff[0], [-0.5 / 4, 0.5 / 4])


@pytest.mark.parametrize('text', [
    layer_text('SoftmaxWithLoss', 'loss_param { ignore_label: 3 normalization: VALID }'),
    layer_text('SoftmaxWithLoss', 'loss_param { ignore_label: 3 normalization: FULL }'),
    layer_text('SoftmaxWithLoss', 'loss_param { ignore_label: 3 normalization: BATCH_SIZE }'),
    layer_text('SoftmaxWithLoss', 'loss_param { ignore_label: 3 normalization: NONE }'),
    layer_text('SigmoidCrossEntropyLoss', 'loss_param { ignore_label: 3 normalization: VALID }'),
    layer_text('InfogainLoss', 'loss_param { ignore_label: 3 }', bottoms=3),
    layer_text('EuclideanLoss'),
    layer_text('HingeLoss'),
    layer_text('MultinomialLogisticLoss'),
])
def test_replicas_equal_one_device_on_the_global_batch(text):
    """Uneven splits with uneven ignored labels: the replica average of losses and
    gradients (a replica's bottom gradient times 1/R) equals one device's."""
    rs = np.random.RandomState(9)
    loss_type = layer_param(text).type
    scores, labels = scores_and_labels(rs, (7, 3, 2), ignore=3, ignore_fraction=0.4)
    if loss_type in ('EuclideanLoss', 'SigmoidCrossEntropyLoss'):
        labels = np.where(rs.uniform(size=scores.shape) < 0.3, 3, rs.randint(0, 2, scores.shape))
    if loss_type in ('HingeLoss', 'MultinomialLogisticLoss'):
        scores, labels = rs.uniform(0.1, 1, (7, 3)), rs.randint(0, 3, 7).astype(float)
    extra = [rs.uniform(0, 1, (3, 3))] if loss_type == 'InfogainLoss' else []
    whole_loss, whole_diff = forward_loss(text, [scores, labels] + extra)

    splits = [slice(0, 2), slice(2, 7)]
    counts = {  # what each replica contributes to the allreduce
        'VALID': lambda s: (labels[s] != 3).sum() if 'ignore_label' in text else labels[s].size,
        'FULL': lambda s: labels[s].size, 'BATCH_SIZE': lambda s: labels[s].shape[0]}
    mode = ('VALID' if 'VALID' in text or loss_type == 'InfogainLoss' else
            'FULL' if 'FULL' in text else 'NONE' if 'NONE' in text else 'BATCH_SIZE')
    global_count = float(sum(counts[mode](s) for s in splits)) if mode != 'NONE' else 0.0
    replicas = [forward_loss(text, [scores[s], labels[s]] + extra,
                             FakeComm(2, global_count)) for s in splits]
    assert np.mean([r[0] for r in replicas]) == pytest.approx(whole_loss, rel=1e-12)
    np.testing.assert_allclose(np.concatenate([r[1] for r in replicas]) / 2, whole_diff,
                               rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------- accuracy

def accuracy(scores, labels, extra='', tops=1):
    layer, bottom, top = build_layer(layer_text('Accuracy', extra, tops=tops), [scores, labels])
    layer.forward(bottom, top)
    return [t.data.copy() for t in top]


def test_accuracy_top_k_and_ties():
    scores = np.array([[0.1, 0.5, 0.4], [0.3, 0.3, 0.4], [0.9, 0.05, 0.05], [0.2, 0.2, 0.6]])
    labels = np.array([2, 1, 0, 0], float)
    (acc,) = accuracy(scores, labels)
    assert acc == pytest.approx(0.25)                 # only item 2; the tie in item 3 loses
    (acc,) = accuracy(scores, labels, 'accuracy_param { top_k: 2 }')
    assert acc == pytest.approx(0.5)                  # items 1 and 3 tie at rank 2 and lose
    acc, per_class = accuracy(scores, labels, 'accuracy_param { top_k: 3 }', tops=2)
    assert acc == 1 and per_class.tolist() == [1, 1, 1]


def test_accuracy_ignore_axis_and_empty_class():
    scores = np.array([[[0.9, 0.1], [0.8, 0.2]], [[0.3, 0.7], [0.6, 0.4]]])   # (N=2, 2, K=2)
    labels = np.array([[0, 1], [1, 4]], float)
    acc, per_class = accuracy(scores, labels, 'accuracy_param { axis: 2 ignore_label: 4 }', 2)
    assert acc == pytest.approx(2 / 3)
    assert per_class.tolist() == [1.0, 0.5]
    acc, per_class = accuracy(scores[:, :, ::-1] * 0 + np.array([1.0, 0.0]),
                              np.zeros((2, 2)), 'accuracy_param { axis: 2 }', 2)
    assert acc == 1 and per_class.tolist() == [1.0, 0.0]   # class 1 has no items: 0


# ----------------------------------------------------------------------------- errors

def test_label_out_of_range_names_the_layer():
    layer, bottom, top = build_layer(layer_text('SoftmaxWithLoss'), [np.zeros((2, 3)),
                                                                     np.array([0.0, 3.0])])
    with pytest.raises(CaffeError, match="layer 'loss'.*\\[0, 3\\).*got 3"):
        layer.forward(bottom, top)


def test_label_count_mismatch():
    with pytest.raises(CaffeError, match='expected 4 labels'):
        layer, bottom, top = build_layer(layer_text('Accuracy'), [np.zeros((2, 3, 2)),
                                                                  np.zeros((2, 3))])
        layer.forward(bottom, top)


def test_missing_infogain_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = layer_text('InfogainLoss', 'infogain_loss_param { source: "nope.binaryproto" }')
    with pytest.raises(CaffeError, match='nope.binaryproto'):
        build_layer(text, [np.zeros((2, 3)), np.zeros(2)])


def test_flags():
    assert create_layer(layer_param(layer_text('HingeLoss')), LayerContext()).is_loss
    accuracy_layer = create_layer(layer_param(layer_text('Accuracy')), LayerContext())
    assert not accuracy_layer.is_loss and not accuracy_layer.allow_force_backward(0)
