"""RefineDet's two-step DetectionOutput and MultiBoxLoss (docs/detection.md): the ARM's moved
priors against a float64 loop of the fork's DecodeBBox, the objectness rule of its
OSGetConfidenceScores and of its mining, against the SSD forms run on the moved priors,
finite differences, the CUDA kernels (emulated) against the array code, one-line errors."""
import numpy as np
import pytest
from google.protobuf import text_format

from caffe_syncbn import Blob, LayerContext, caffe_pb2
from caffe_syncbn.layer import create_layer
from caffe_syncbn.layers.detection import boxes, gpu as detection_gpu
from caffe_syncbn.testing import build_layer, check_gradient
from helpers.cuda_emulation import emulated_kernels
from helpers.messages import error_of, one_line

RS = np.random.RandomState(15)
CLASSES = 3


def forward(text, bottoms, dtype=np.float64):
    layer, bottom, top = build_layer(text, bottoms, dtype=dtype)
    layer.forward(bottom, top)
    return layer, bottom, top


def decode_center_size_loop(prior, variance, offsets):
    """DecodeBBox of the SSD tree for CENTER_SIZE with the variances in the prior."""
    width, height = prior[2] - prior[0], prior[3] - prior[1]
    cx = variance[0] * offsets[0] * width + (prior[0] + prior[2]) / 2
    cy = variance[1] * offsets[1] * height + (prior[1] + prior[3]) / 2
    w = np.exp(variance[2] * offsets[2]) * width
    h = np.exp(variance[3] * offsets[3]) * height
    return [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]


def problem(rs, images=2, priors=24):
    centres = rs.uniform(0.25, 0.75, (priors, 2))
    sizes = rs.uniform(0.15, 0.4, (priors, 2))
    boxes = np.concatenate([centres - sizes / 2, centres + sizes / 2], axis=1)
    prior_blob = np.stack([boxes.ravel(), np.tile([0.1, 0.1, 0.2, 0.2], priors)])[None]
    arm_prob = rs.uniform(0, 1, (images, priors))
    arm_conf = np.stack([1 - arm_prob, arm_prob], axis=2).reshape(images, -1)
    return {'loc': 0.3 * rs.standard_normal((images, priors * 4)),
            'conf': rs.standard_normal((images, priors * CLASSES)),
            'priors': prior_blob, 'arm_conf': arm_conf,
            'arm_loc': 0.5 * rs.standard_normal((images, priors * 4))}


def moved_priors(p, image):
    """The priors of ``image`` moved by its ARM offsets, as PriorBox's top (1, 2, P * 4)."""
    boxes = p['priors'][0, 0].reshape(-1, 4)
    variances = p['priors'][0, 1].reshape(-1, 4)
    offsets = p['arm_loc'][image].reshape(-1, 4)
    moved = [decode_center_size_loop(b, v, o) for b, v, o in zip(boxes, variances, offsets)]
    return np.stack([np.ravel(moved), p['priors'][0, 1]])[None]


# ---- DetectionOutput -----------------------------------------------------------------------
OUTPUT = ('name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "priors" %s '
          'top: "out" detection_output_param { num_classes: %d share_location: true '
          'background_label_id: 0 nms_param { nms_threshold: 0.45 top_k: 50 } '
          'code_type: CENTER_SIZE keep_top_k: 20 confidence_threshold: 0.1 %s }')


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def rows_by_image(top):
    rows = top[0].data.reshape(-1, 7)
    return {image: rows[rows[:, 0] == image] for image in np.unique(rows[:, 0])}


@pytest.mark.parametrize('score', [0.01, 0.5])
def test_two_step_output_is_the_ssd_output_on_the_moved_priors(score):
    p = problem(np.random.RandomState(2))
    conf = softmax(p['conf'].reshape(2, -1, CLASSES)).reshape(2, -1)
    text = OUTPUT % ('bottom: "arm_conf" bottom: "arm_loc"', CLASSES,
                     'objectness_score: %g' % score)
    _, _, top = forward(text, [p['loc'], conf, p['priors'], p['arm_conf'], p['arm_loc']])
    got = rows_by_image(top)
    objectness = p['arm_conf'].reshape(2, -1, 2)[..., 1]
    for image in range(2):
        # OSGetConfidenceScores: a prior whose objectness is below the score says class 0
        scores = conf[image].reshape(-1, CLASSES).copy()
        low = objectness[image] < np.float32(score)
        scores[low] = [1.0, 0.0, 0.0]
        _, _, ssd = forward(OUTPUT % ('', CLASSES, ''), [p['loc'][image:image + 1],
                                                         scores.reshape(1, -1),
                                                         moved_priors(p, image)])
        expected = ssd[0].data.reshape(-1, 7).copy()
        expected[:, 0] = image
        np.testing.assert_allclose(got[image], expected, rtol=1e-12, atol=1e-14)
    if score == 0.5:        # the rule left out some priors that would have been found
        _, _, plain = forward(text.replace('objectness_score: 0.5', 'objectness_score: 0'),
                              [p['loc'], conf, p['priors'], p['arm_conf'], p['arm_loc']])
        assert len(plain[0].data.reshape(-1, 7)) > len(top[0].data.reshape(-1, 7))


def test_four_bottoms_read_the_objectness_without_moving_the_priors():
    p = problem(np.random.RandomState(4))
    conf = softmax(p['conf'].reshape(2, -1, CLASSES)).reshape(2, -1)
    text = OUTPUT % ('bottom: "arm_conf"', CLASSES, 'objectness_score: 0.3')
    _, _, top = forward(text, [p['loc'], conf, p['priors'], p['arm_conf']])
    filtered = conf.reshape(2, -1, CLASSES).copy()
    filtered[p['arm_conf'].reshape(2, -1, 2)[..., 1] < np.float32(0.3)] = [1, 0, 0]
    _, _, ssd = forward(OUTPUT % ('', CLASSES, ''), [p['loc'], filtered.reshape(2, -1),
                                                     p['priors']])
    np.testing.assert_allclose(top[0].data, ssd[0].data, rtol=1e-12)


def test_a_fourth_bottom_of_another_size_is_the_ssd_forks_image():
    p = problem(np.random.RandomState(4))
    image = RS.standard_normal((2, 3, 8, 8))
    _, _, with_image = forward(OUTPUT % ('bottom: "data"', CLASSES, ''),
                               [p['loc'], p['conf'], p['priors'], image])
    _, _, without = forward(OUTPUT % ('', CLASSES, ''), [p['loc'], p['conf'], p['priors']])
    np.testing.assert_array_equal(with_image[0].data, without[0].data)


# ---- MultiBoxLoss --------------------------------------------------------------------------
LOSS = ('name: "odm_loss" type: "MultiBoxLoss" bottom: "loc" bottom: "conf" bottom: "priors" '
        'bottom: "label" %s top: "loss" loss_param { normalization: %s } '
        'multibox_loss_param { num_classes: %d overlap_threshold: 0.4 code_type: CENTER_SIZE '
        'neg_pos_ratio: 2 neg_overlap: 0.5 %s }')


def ground_truth(rs, images):
    rows = []
    for image in range(images):
        for _ in range(2):
            xy = rs.uniform(0.2, 0.5, 2)
            rows.append([image, rs.randint(1, CLASSES), 0, *xy, *(xy + rs.uniform(0.15, 0.3, 2)),
                         0])
    return np.array(rows)[None, None]


def run_loss(text, bottoms, propagate):
    layer, bottom, top = forward(text, bottoms)
    top[0].diff[...] = 1
    layer.backward(top, propagate, bottom)
    return float(top[0].data), bottom[0].diff.copy(), bottom[1].diff.copy()


def test_two_step_loss_is_the_ssd_loss_on_the_moved_priors():
    """Each image's ODM loss (normalization NONE: plain sums) is the SSD loss of that image
    on its moved priors, when every prior's objectness passes."""
    rs = np.random.RandomState(7)
    p = problem(rs)
    labels = ground_truth(rs, 2)
    p['arm_conf'][:, 1::2] = 0.9
    text = LOSS % ('bottom: "arm_conf" bottom: "arm_loc"', 'NONE', CLASSES, '')
    loss, loc_diff, conf_diff = run_loss(
        text, [p['loc'], p['conf'], p['priors'], labels, p['arm_conf'], p['arm_loc']],
        [True, True, False, False, False, False])
    total = 0.0
    for image in range(2):
        rows = labels.reshape(-1, 8)
        mine = rows[rows[:, 0] == image].copy()
        mine[:, 0] = 0
        ssd = run_loss(LOSS % ('', 'NONE', CLASSES, ''),
                       [p['loc'][image:image + 1], p['conf'][image:image + 1],
                        moved_priors(p, image), mine[None, None]], [True, True, False, False])
        total += ssd[0]
        np.testing.assert_allclose(loc_diff[image], ssd[1][0], rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(conf_diff[image], ssd[2][0], rtol=1e-10, atol=1e-13)
    assert loss == pytest.approx(total, rel=1e-12)


def test_objectness_keeps_low_priors_out_of_the_mined_negatives():
    rs = np.random.RandomState(9)
    p = problem(rs, priors=40)
    labels = ground_truth(rs, 2)
    bottoms = [p['loc'], p['conf'], p['priors'], labels, p['arm_conf']]
    propagate = [True, True, False, False, False]
    text = LOSS % ('bottom: "arm_conf"', 'VALID', CLASSES, 'objectness_score: %g')
    _, _, everyone = run_loss(text % 0.0, bottoms, propagate)
    _, _, filtered = run_loss(text % 0.6, bottoms, propagate)
    low = p['arm_conf'].reshape(2, -1, 2)[..., 1] < np.float32(0.6)
    conf_of = {name: np.abs(diff.reshape(2, -1, CLASSES)).sum(axis=2) > 0
               for name, diff in (('all', everyone), ('filtered', filtered))}
    positives = _positives(p, labels)
    # a low-objectness prior learns only when it is a positive
    assert not np.any(conf_of['filtered'] & low & ~positives)
    assert np.any(conf_of['all'] & low & ~positives)
    # the positives are the same; the mining took others in place of the low ones
    assert np.array_equal(conf_of['filtered'] & positives, conf_of['all'] & positives)


def test_two_class_loss_reads_every_object_label_as_the_object():
    """RefineDet's ARM loss (num_classes 2) trains on the dataset's labels: a box of class 5
    is an object, as one of class 1 (the SSD fork stops on label 5)."""
    rs = np.random.RandomState(11)
    p = problem(rs)
    p['conf'] = rs.standard_normal((2, 24 * 2))
    labels = ground_truth(rs, 2)
    objects = labels.copy()
    objects[..., 1] = 1
    dataset = labels.copy()
    dataset[..., 1] = [5, 1, 80, 2]
    text = LOSS % ('', 'VALID', 2, '')
    propagate = [True, True, False, False]
    expected = run_loss(text, [p['loc'], p['conf'], p['priors'], objects], propagate)
    got = run_loss(text, [p['loc'], p['conf'], p['priors'], dataset], propagate)
    assert got[0] == expected[0] > 0
    np.testing.assert_array_equal(got[1], expected[1])
    np.testing.assert_array_equal(got[2], expected[2])


def _positives(p, labels):
    """The priors matched (normalization NONE, no mining: only the matched learn loc)."""
    text = LOSS % ('bottom: "arm_conf"', 'NONE', CLASSES, 'mining_type: NONE')
    _, loc_diff, _ = run_loss(text, [p['loc'], p['conf'], p['priors'], labels, p['arm_conf']],
                              [True, True, False, False, False])
    return np.abs(loc_diff.reshape(2, -1, 4)).sum(axis=2) > 0


@pytest.mark.parametrize('arm', ['bottom: "arm_conf"', 'bottom: "arm_conf" bottom: "arm_loc"'])
def test_two_step_loss_gradient_matches_finite_differences(arm):
    rs = np.random.RandomState(11)
    p = problem(rs)
    bottoms = [p['loc'], p['conf'], p['priors'], ground_truth(rs, 2), p['arm_conf']]
    if 'arm_loc' in arm:
        bottoms.append(p['arm_loc'])
    text = LOSS % (arm, 'VALID', CLASSES, 'objectness_score: 0.3')
    check_gradient(text, bottoms, check_bottom=[0, 1], tolerance=1e-5)


@pytest.mark.parametrize('case, message', [
    ('arm_conf_size', 'ARM objectness (bottom 4) must hold 48 values per image (24 priors x 2), '
                      'got shape (2, 46)'),
    ('no_share', "RefineDet's ARM offsets (bottom 5) need share_location: true"),
    ('backward', 'cannot backpropagate to bottom 5 (ARM offsets); give the layer '
                 'propagate_down: true true false false false false'),
])
def test_two_step_loss_bad_input_is_one_line(case, message):
    rs = np.random.RandomState(1)
    p = problem(rs)
    bottoms = [p['loc'], p['conf'], p['priors'], ground_truth(rs, 2), p['arm_conf'], p['arm_loc']]
    text = LOSS % ('bottom: "arm_conf" bottom: "arm_loc"', 'VALID', CLASSES, '')
    if case == 'arm_conf_size':
        bottoms[4] = bottoms[4][:, :46]
    elif case == 'no_share':
        text = text.replace('num_classes', 'share_location: false mining_type: NONE '
                                           'num_classes')
        bottoms[0] = np.zeros((2, 24 * 4 * CLASSES))

    def run():
        run_loss(text, bottoms, [True, True, False, False, False, case == 'backward'])
    one_line(error_of(run), 'odm_loss', message)


def test_two_step_output_bad_arm_offsets_are_one_line():
    p = problem(RS)
    text = OUTPUT % ('bottom: "arm_conf" bottom: "arm_loc"', CLASSES, '')
    line = error_of(forward, text, [p['loc'], p['conf'], p['priors'], p['arm_conf'],
                                    p['arm_loc'][:, :-4]])
    one_line(line, 'det', 'ARM offsets (bottom 4) must hold 96 values per item for 24 priors x 4')


@pytest.mark.parametrize('dtype', [np.float64, np.float32])
def test_two_step_forms_on_the_kernels_equal_the_array_code(monkeypatch, dtype):
    emulated_kernels(monkeypatch)
    rs = np.random.RandomState(13)
    p = problem(rs)
    labels = ground_truth(rs, 2)
    conf = softmax(p['conf'].reshape(2, -1, CLASSES)).reshape(2, -1)
    cases = [(OUTPUT % ('bottom: "arm_conf" bottom: "arm_loc"', CLASSES, 'objectness_score: 0.2'),
              [p['loc'], conf, p['priors'], p['arm_conf'], p['arm_loc']]),
             (LOSS % ('bottom: "arm_conf" bottom: "arm_loc"', 'VALID', CLASSES,
                      'objectness_score: 0.2'),
              [p['loc'], p['conf'], p['priors'], labels, p['arm_conf'], p['arm_loc']])]
    tolerance = 1e-10 if dtype == np.float64 else 1e-5
    for text, arrays in cases:
        param = text_format.Parse(text, caffe_pb2.LayerParameter())
        results = []
        for kernels in (False, True):
            ctx = LayerContext(dtype=dtype, cuda_kernels=kernels)
            layer = create_layer(param, ctx)
            bottom = [Blob(np.shape(a), dtype) for a in arrays]
            for blob, array in zip(bottom, arrays):
                blob.data[...] = array
            top = [Blob((), dtype)]
            layer.setup(bottom, top)
            layer.reshape(bottom, top)
            assert layer.engine is (detection_gpu if kernels else boxes)
            layer.forward(bottom, top)
            outputs = [top[0].data.copy()]
            assert layer.is_loss or len(outputs[0].reshape(-1, 7)) > 3
            if layer.is_loss:
                top[0].diff[...] = 1
                layer.backward(top, [True, True] + [False] * 4, bottom)
                outputs += [bottom[0].diff.copy(), bottom[1].diff.copy()]
            results.append(outputs)
        for host, fast in zip(*results):
            assert host.shape == fast.shape and np.count_nonzero(host)
            np.testing.assert_allclose(fast, host, rtol=tolerance, atol=tolerance)
