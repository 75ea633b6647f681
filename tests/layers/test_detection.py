"""The SSD layers (Permute, Normalize, PriorBox, DetectionOutput, DetectionEvaluate)
against the SSD fork of Caffe (goldens in tests/ssd_golden, see its README.md), finite
differences, and the detection mAP of the fork's solver."""

import numpy as np
import pytest
from google.protobuf import text_format

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layers.detection.boxes import average_precision, detection_map, greedy_nms
from caffe_syncbn.testing import build_layer, check_gradient
from helpers.paths import SSD_GOLDEN as GOLDEN

LAYER_CASES = sorted(p.stem for p in GOLDEN.glob('*.npz')
                     # whole nets: below, and test_ssd_mobilenet.py
                     if p.stem not in ('mini_ssd', 'detection_map', 'mobilenet_ssd')
                     # test_detection_multibox_loss.py, test_data_annotated.py, test_ssd_training.py
                     and not p.stem.startswith(('multibox_loss', 'annotated_data',
                                                'solver_tiny_ssd')))
# The fork's Normalize backward multiplies by each channel's scale after projecting out
# the normalized direction, which is the gradient only when every channel has the same
# scale; for varied scales the bottom diff is checked against finite differences instead.
FORK_GRADIENT_IS_WRONG = {'normalize_per_position_varied_scale',
                          'normalize_across_spatial_varied_scale'}


def golden_layer(name):
    net = text_format.Parse((GOLDEN / (name + '.prototxt')).read_text(), caffe_pb2.NetParameter())
    return net.layer[-1], np.load(GOLDEN / (name + '.npz'))


def run_golden_layer(name, dtype=np.float32):
    param, ref = golden_layer(name)
    layer, bottom, top = build_layer(param, [ref['data/' + b] for b in param.bottom], dtype=dtype)
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = ref['param/%d' % i]
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return param, ref, layer, bottom, top


@pytest.mark.parametrize('name', LAYER_CASES)
def test_layer_matches_the_fork(name):
    param, ref, layer, bottom, top = run_golden_layer(name)
    for blob, top_name in zip(top, param.top):
        expected = ref['data/' + top_name]
        assert blob.data.shape == expected.shape
        # detections must be the same rows: image and label exactly, the rest to float32
        np.testing.assert_allclose(blob.data, expected, rtol=1e-5, atol=1e-6, err_msg=top_name)
    if 'topdiff/' + param.top[0] not in ref.files:
        return
    for blob, top_name in zip(top, param.top):
        blob.diff[...] = ref['topdiff/' + top_name]
    for blob in layer.blobs:
        blob.diff[...] = 0
    layer.backward(top, [True] * len(bottom), bottom)
    for i, blob in enumerate(layer.blobs):
        np.testing.assert_allclose(blob.diff, ref['param_diff/%d' % i], rtol=1e-4, atol=1e-5)
    for blob, bottom_name in zip(bottom, param.bottom):
        if name in FORK_GRADIENT_IS_WRONG:
            assert np.abs(blob.diff - ref['diff/' + bottom_name]).max() > 1e-2
        else:
            np.testing.assert_allclose(blob.diff, ref['diff/' + bottom_name],
                                       rtol=1e-4, atol=1e-5, err_msg=bottom_name)


@pytest.mark.parametrize('name', sorted(n for n in LAYER_CASES
                                        if n.startswith(('normalize', 'permute'))))
def test_gradient_by_finite_differences(name):
    param, ref = golden_layer(name)
    x = ref['data/' + param.bottom[0]].astype(np.float64)[:1, :3]   # keep it small
    if param.type == 'Normalize' and not param.norm_param.channel_shared:
        # a per-channel scale from the filler's range, so the channels differ
        param = caffe_pb2.LayerParameter.FromString(param.SerializeToString())
        param.norm_param.scale_filler.CopyFrom(
            caffe_pb2.FillerParameter(type='uniform', min=0.5, max=3))
    check_gradient(param, [x], tolerance=1e-6)


def test_normalize_scale_blob_of_the_fork_caffemodel_shape():
    """channel_shared keeps its scale in a blob with no axes, as the fork writes it."""
    param, ref = golden_layer('normalize_defaults')
    layer, _, _ = build_layer(param, [ref['data/x']])
    assert layer.blobs[0].shape == () and float(layer.blobs[0].data) == 2.5


def test_priorbox_truncates_sizes_and_drops_repeated_ratios():
    param, _ = golden_layer('prior_box_truncated_sizes_steps')
    layer, _, top = build_layer(param, [np.zeros((1, 1, 3, 4)), np.zeros((1, 3, 100, 150))])
    assert layer.min_sizes == [30] and layer.max_sizes == [45]
    assert layer.aspect_ratios == [1.0, 2.0, pytest.approx(0.5)]    # 0.5 given again; 1 dropped
    assert top[0].shape == (1, 2, 3 * 4 * 4 * 4)


def test_detection_output_uses_scores_as_given():
    """No softmax inside: scores above 1 pass through, and boxes are not clipped."""
    param = text_format.Parse(
        'name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "priors" '
        'top: "out" detection_output_param { num_classes: 2 nms_param { nms_threshold: 0.5 } '
        'code_type: CORNER variance_encoded_in_target: true }', caffe_pb2.LayerParameter())
    priors = np.array([[-0.2, 0.1, 0.5, 0.6, 0.6, 0.6, 1.3, 0.9],     # two boxes
                       [1] * 8], np.float32).reshape(1, 2, 8)          # their variances
    conf = np.array([[0.0, 5.0, 0.0, 3.0]], np.float32)
    layer, bottom, top = build_layer(param, [np.zeros((1, 8)), conf, priors], dtype=np.float32)
    layer.forward(bottom, top)
    np.testing.assert_allclose(top[0].data[0, 0], [[0, 1, 5, -0.2, 0.1, 0.5, 0.6],
                                                   [0, 1, 3, 0.6, 0.6, 1.3, 0.9]], rtol=1e-6)


def test_nms_threshold_shrinks_only_while_above_one_half():
    # three boxes overlapping their predecessor by 0.6 (IoU of a 1x1 box shifted by 0.25)
    boxes = np.array([[0, 0, 1, 1], [0.25, 0, 1.25, 1], [5, 5, 6, 6], [0.5, 0, 1.5, 1]], float)
    scores = np.array([0.9, 0.8, 0.7, 0.6])
    assert greedy_nms(boxes, scores, 0, 0.65, 1.0, -1) == [0, 1, 2, 3]
    # eta 0.9: 0.65 -> 0.585 after box 0, so box 1 (0.6) is suppressed
    assert greedy_nms(boxes, scores, 0, 0.65, 0.9, -1) == [0, 2, 3]
    # below 0.5 the threshold stays: 0.55 -> 0.495 once, then no more shrinking
    assert greedy_nms(boxes, scores, 0, 0.55, 0.9, -1) == [0, 2, 3]
    assert greedy_nms(boxes, scores, 0.75, 0.65, 1.0, 1) == [0]


def test_detection_map_matches_the_fork_solver():
    """The fork's solver (eval_type "detection") over three test iterations: its mAP and
    per-class APs, for each ap_version; label 5 has no ground truth and counts as 0."""
    ref = np.load(GOLDEN / 'detection_map.npz')
    param = text_format.Parse((GOLDEN / 'detection_map.prototxt').read_text(),
                              caffe_pb2.NetParameter()).layer[-1]
    evaluations = []
    for i in range(3):
        layer, bottom, top = build_layer(param, [ref['det%d' % i], ref['gt%d' % i]],
                                         dtype=np.float32)
        layer.forward(bottom, top)
        evaluations.append(top[0].data.copy())
    for version in ('11point', 'MaxIntegral', 'Integral'):
        mean, aps = detection_map(evaluations, version)
        assert mean == pytest.approx(float(ref['map/' + version]), abs=2e-6), version
        assert aps[5] == 0.0
        for label in (1, 2, 3, 4):
            assert aps[label] == pytest.approx(float(ref['ap/%s/%d' % (version, label)]),
                                               abs=2e-6), (version, label)


def test_eleven_point_ap_compares_float32_recall_with_float64_levels():
    """7 of 10 found reads as recall 0.699999988 in float32: below the 0.7 level."""
    hits = [(1.0 - i / 100, 1) for i in range(7)] + [(0.5, 0)]
    assert average_precision(hits, 10, '11point') == pytest.approx(7 / 11, abs=1e-6)
    with pytest.raises(ValueError, match='ap_version'):
        average_precision(hits, 10, 'VOC2012')


def test_small_mobilenet_ssd_net_matches_the_fork(monkeypatch):
    monkeypatch.chdir(GOLDEN)
    ref = np.load('mini_ssd.npz')
    net = caffe.Net('mini_ssd_deploy.prototxt', caffe.TEST, weights='mini_ssd.caffemodel')
    net.forward(data=ref['data/data'])
    for blob in ('mbox_loc', 'mbox_conf_flatten', 'mbox_priorbox'):
        np.testing.assert_allclose(net.blobs[blob].data, ref['data/' + blob],
                                   rtol=1e-4, atol=1e-4, err_msg=blob)
    ours, theirs = net.blobs['detection_out'].data[0, 0], ref['data/detection_out'][0, 0]
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours[:, :2], theirs[:, :2])
    np.testing.assert_allclose(ours[:, 2:], theirs[:, 2:], atol=1e-4)


@pytest.mark.parametrize('text, bottoms, message', [
    ('type: "PriorBox" prior_box_param { aspect_ratio: 2 }', [(1, 1, 2, 2), (1, 3, 8, 8)],
     'needs at least one min_size'),
    ('type: "PriorBox" prior_box_param { min_size: 10 max_size: 5 }',
     [(1, 1, 2, 2), (1, 3, 8, 8)], 'max_size 5 must be greater than its min_size 10'),
    ('type: "PriorBox" prior_box_param { min_size: 10 variance: 0.1 variance: 0.2 }',
     [(1, 1, 2, 2), (1, 3, 8, 8)], 'variance takes 1 or 4 values, got 2'),
    ('type: "PriorBox" prior_box_param { min_size: 10 step: 8 step_h: 4 step_w: 4 }',
     [(1, 1, 2, 2), (1, 3, 8, 8)], 'set either step or step_h/step_w, not both'),
    ('type: "Permute" permute_param { order: 0 order: 0 }', [(2, 3)], 'repeats an axis'),
    ('type: "Permute" permute_param { order: 3 }', [(2, 3)],
     'order 3 is out of range for a bottom of 2 axes'),
    ('type: "Normalize"', [(4,)], 'at least 2 axes'),
    ('type: "DetectionOutput" detection_output_param { num_classes: 3 }',
     [(1, 12), (1, 6), (1, 2, 8)],
     '12 location values per item for 2 priors x 1 x 4 (expected 8)'),
    ('type: "DetectionOutput" detection_output_param { num_classes: 3 }',
     [(1, 8), (1, 4), (1, 2, 8)], '4 confidence values per item for 2 priors x 3 classes '
                                  '(expected 6)'),
    ('type: "DetectionOutput" detection_output_param { num_classes: 3 nms_param { eta: 0 } }',
     [(1, 8), (1, 6), (1, 2, 8)], 'eta must be in (0, 1], got 0'),
    ('type: "DetectionOutput"', [(1, 8), (1, 6), (1, 2, 8)], 'needs num_classes'),
    ('type: "DetectionOutput" detection_output_param { num_classes: 3 visualize: true }',
     [(1, 8), (1, 6), (1, 2, 8)], 'visualize: drawing the detections is not implemented: '
                                  'remove it and read the top instead'),
    ('type: "DetectionEvaluate" detection_evaluate_param { num_classes: 3 }',
     [(1, 1, 2, 6), (1, 1, 2, 8)], 'detection bottom must have shape (1, 1, rows, 7)'),
])
def test_bad_settings_and_shapes_name_the_layer(text, bottoms, message):
    tops = ' top: "t"'
    param = text_format.Parse('name: "bad" %s %s' % (text, tops), caffe_pb2.LayerParameter())
    param.bottom.extend('b%d' % i for i in range(len(bottoms)))
    with pytest.raises(CaffeError) as info:
        build_layer(param, [np.zeros(shape) for shape in bottoms])
    assert "layer 'bad'" in str(info.value) and message in str(info.value)


def test_detection_output_without_background_and_shared_boxes():
    """background_label_id -1 with shared boxes: every class is scored (the fork aborts)."""
    param = text_format.Parse(
        'name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "priors" '
        'top: "out" detection_output_param { num_classes: 2 background_label_id: -1 }',
        caffe_pb2.LayerParameter())
    priors = np.array([[0, 0, 0.5, 0.5, 0.5, 0.5, 1, 1], [0.1] * 8], np.float32).reshape(1, 2, 8)
    conf = np.array([[0.3, 0.7, 0.6, 0.4]], np.float32)
    layer, bottom, top = build_layer(param, [np.zeros((1, 8)), conf, priors], dtype=np.float32)
    layer.forward(bottom, top)
    np.testing.assert_allclose(top[0].data[0, 0], [[0, 0, 0.6, 0.5, 0.5, 1, 1],
                                                   [0, 0, 0.3, 0, 0, 0.5, 0.5],
                                                   [0, 1, 0.7, 0, 0, 0.5, 0.5],
                                                   [0, 1, 0.4, 0.5, 0.5, 1, 1]], rtol=1e-6)


def test_save_output_param_is_a_warning_and_the_top_holds_the_detections(records, tmp_path):
    """The SSD fork's deploy nets keep the test net's save_output_param (ssd_pascal.py):
    they run, with one warning that no result files are written, and the same detections."""
    rs = np.random.RandomState(3)
    bottoms = [rs.uniform(-1, 1, (1, 8)), rs.uniform(0, 1, (1, 6)),
               np.tile([[[0.1, 0.1, 0.4, 0.4, 0.5, 0.5, 0.9, 0.9]]], (1, 2, 1))]
    outputs = []
    for extra in ('', ' save_output_param { output_directory: "%s" output_format: "VOC" }'
                  % (tmp_path / 'results')):
        param = text_format.Parse(
            'name: "det" type: "DetectionOutput" top: "t" detection_output_param { num_classes: '
            '3 nms_param { nms_threshold: 0.45 } %s }' % extra, caffe_pb2.LayerParameter())
        param.bottom.extend('b%d' % i for i in range(3))
        layer, bottom, top = build_layer(param, bottoms)
        layer.forward(bottom, top)
        outputs.append(np.asarray(top[0].data).copy())
    warnings = [r.getMessage() for r in records if r.levelname == 'WARNING']
    assert warnings == ["layer 'det': save_output_param.output_directory: the SSD fork's VOC or "
                        'COCO result files are not written here; the top holds the detections '
                        '(remove save_output_param to silence this)']
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert outputs[0].shape[2] > 0 and not (tmp_path / 'results').exists()
