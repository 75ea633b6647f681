"""The YOLO ports' layers (docs/fork-layers.md, docs/detection.md): Reorg and Region against
float64 loops written from the forks' sources, with finite differences; MobileNet-YOLO's
YoloDetectionOutput and Yolov3DetectionOutput against loops written from that fork's CPU
forward (decoding, the sort and its class-agnostic NMS), per image; one-line errors."""
import math

import numpy as np
import pytest

from caffe_syncbn.testing import build_layer, check_gradient
from helpers.messages import error_of, one_line

RS = np.random.RandomState(32)


def forward(text, bottoms, dtype=np.float64):
    layer, bottom, top = build_layer(text, bottoms, dtype=dtype)
    layer.forward(bottom, top)
    return layer, bottom, top


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


# ---- Reorg ---------------------------------------------------------------------------------
def darknet_reorg_loop(x, w, h, c, batch, stride, forward_flag):
    """reorg_cpu of the forks' reorg_layer.hpp, index for index."""
    out = np.zeros(x.size)
    out_c = c // (stride * stride)
    for b in range(batch):
        for k in range(c):
            for j in range(h):
                for i in range(w):
                    in_index = i + w * (j + h * (k + c * b))
                    c2 = k % out_c
                    offset = k // out_c
                    w2 = i * stride + offset % stride
                    h2 = j * stride + offset // stride
                    out_index = w2 + w * stride * (h2 + h * stride * (c2 + out_c * b))
                    if forward_flag:
                        out[out_index] = x[in_index]
                    else:
                        out[in_index] = x[out_index]
    return out


REORG = 'name: "reorg" type: "Reorg" bottom: "x" top: "y" reorg_param { stride: %d %s }'


@pytest.mark.parametrize('stride, shape, reverse', [
    (2, (2, 8, 6, 4), False), (3, (1, 9, 6, 9), False), (2, (2, 8, 3, 5), True),
    (1, (1, 3, 2, 2), False)])
def test_reorg_is_darknets_permutation(stride, shape, reverse):
    x = RS.standard_normal(shape)
    text = REORG % (stride, 'reverse: true' if reverse else '')
    _, _, top = forward(text, [x])
    n, c, h, w = shape
    # the layer calls reorg_cpu(bottom, W, H, C, N, stride, forward = reverse)
    expected = darknet_reorg_loop(x.reshape(-1), w, h, c, n, stride, reverse)
    square = stride * stride
    want = (n, c // square, h * stride, w * stride) if reverse else \
        (n, c * square, h // stride, w // stride)
    assert top[0].shape == want
    np.testing.assert_array_equal(top[0].data.reshape(-1), expected)


@pytest.mark.parametrize('reverse', [False, True])
def test_reorg_backward_is_the_exact_gradient(reverse):
    """The forks' backward reads a blob nothing writes and gives zeros; ours is exact."""
    x = RS.standard_normal((2, 8, 4, 2))
    text = REORG % (2, 'reverse: true' if reverse else '')
    check_gradient(text, [x])
    layer, bottom, top = forward(text, [x])
    top[0].diff[...] = RS.standard_normal(top[0].shape)
    layer.backward(top, [True], bottom)
    # the inverse permutation moves every value back: a sum of squares is kept
    assert np.isclose(np.sum(bottom[0].diff ** 2), np.sum(top[0].diff ** 2))
    assert np.count_nonzero(bottom[0].diff) == bottom[0].diff.size


@pytest.mark.parametrize('text, shape, message', [
    ('name: "reorg" type: "Reorg" bottom: "x" top: "y"', (1, 4, 2, 2),
     'reorg_param needs a positive stride, got none'),
    (REORG % (2, ''), (1, 6, 4, 4), 'the channels (6) must be a multiple of 4'),
    (REORG % (2, ''), (1, 8, 5, 4), 'stride 2 must divide the height and width, got 5 x 4'),
])
def test_reorg_bad_input_is_one_line(text, shape, message):
    line = one_line(error_of(forward, text, [RS.standard_normal(shape)]), 'reorg', message)
    assert line.startswith("layer 'reorg' (type Reorg): "), line


# ---- Region --------------------------------------------------------------------------------
def region_loop(x, classes, boxes, softmax):
    """lwplw/caffe_yolov2's Forward_cpu: darknet's flatten, the logistic at index + 4 of
    every box, the softmax over index + 5 ... (with softmax)."""
    batch, channels, height, width = x.shape
    flat = x.reshape(-1)
    top = np.zeros(x.size)
    size = 4 + classes + 1
    area = height * width
    for b in range(batch):
        for c in range(channels):
            for i in range(area):
                start = b * channels * area
                top[start + i * channels + c] = flat[start + c * area + i]
    for b in range(batch):
        for i in range(area * boxes):
            index = size * i + b * area * channels
            top[index + 4] = sigmoid(top[index + 4])
            if softmax:
                values = top[index + 5:index + 5 + classes]
                largest = max(values)
                e = [math.exp(v - largest) for v in values]
                top[index + 5:index + 5 + classes] = [v / sum(e) for v in e]
    return top.reshape(x.shape)


REGION = ('name: "region" type: "Region" bottom: "x" top: "y" region_param { classes: %d '
          'boxes_of_each_grid: %d softmax: %s }')


@pytest.mark.parametrize('classes, boxes, softmax, hw', [
    (3, 2, True, (3, 4)), (20, 5, True, (2, 2)), (2, 3, False, (4, 1))])
def test_region_matches_the_ports_forward(classes, boxes, softmax, hw):
    x = 2 * RS.standard_normal((2, boxes * (5 + classes)) + hw)
    text = REGION % (classes, boxes, 'true' if softmax else 'false')
    _, _, top = forward(text, [x])
    np.testing.assert_allclose(top[0].data, region_loop(x, classes, boxes, softmax),
                               rtol=1e-13, atol=1e-15)
    # the port writes no gradient; ours is exact
    check_gradient(text, [x])


def test_region_float32_agrees_with_float64():
    x = RS.standard_normal((1, 2 * 8, 3, 3))
    text = REGION % (3, 2, 'true')
    _, _, top64 = forward(text, [x])
    _, _, top32 = forward(text, [x], np.float32)
    np.testing.assert_allclose(top32[0].data, top64[0].data, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize('settings, channels, message', [
    ('classes: 3 boxes_of_each_grid: 2', 15, 'bottom must be (N, 16, H, W): 2 boxes of '
                                              '4 + 1 + 3 classes, got (1, 15, 2, 2)'),
    ('classes: 3 coords: 5', 45, 'region_param.coords must be 4 (x, y, w, h), got 5'),
])
def test_region_bad_input_is_one_line(settings, channels, message):
    text = 'name: "region" type: "Region" bottom: "x" top: "y" region_param { %s }' % settings
    one_line(error_of(forward, text, [RS.standard_normal((1, channels, 2, 2))]), message)


# ---- the detection outputs -----------------------------------------------------------------
def fork_iou(a, b):
    """box_iou of the fork (boxes as x, y, w, h)."""
    def overlap(x1, w1, x2, w2):
        return min(x1 + w1 / 2, x2 + w2 / 2) - max(x1 - w1 / 2, x2 - w2 / 2)
    w = overlap(a[0], a[2], b[0], b[2])
    h = overlap(a[1], a[3], b[1], b[3])
    inter = 0.0 if w < 0 or h < 0 else w * h
    union = a[2] * a[3] + b[2] * b[3] - inter
    return inter / union if union else math.nan


def fork_nms_rows(image, predicts, threshold):
    """std::sort by confidence (the stable order stands in for its unspecified order of
    ties), ApplyNms, and the rows the fork writes (with this image's index)."""
    predicts = sorted(predicts, key=lambda p: -p['confidence'])
    suppressed = set()
    for i in range(len(predicts) - 1):
        if i in suppressed:
            continue
        for j in range(i + 1, len(predicts)):
            if j in suppressed:
                continue
            if fork_iou(predicts[i]['box'], predicts[j]['box']) >= threshold:
                suppressed.add(j)
    rows = []
    for i, p in enumerate(predicts):
        if i not in suppressed:
            x, y, w, h = p['box']
            rows.append([image, p['class'] + 1, p['confidence'],
                         x - w / 2, y - h / 2, x + w / 2, y + h / 2])
    return rows


def yolov2_loop(bottoms, classes, num_box, biases, threshold, nms, image):
    """YoloDetectionOutput's Forward_cpu for one image: the swap to (cell, box, values),
    get_region_box, sigmoid objectness, class_index_and_score, confidence >= threshold."""
    predicts = []
    for blob in bottoms:
        _, channels, height, side = blob.shape
        per = channels // num_box
        for j in range(side):
            for i in range(side):
                for n in range(num_box):
                    v = [blob[image, n * per + k, j, i] for k in range(per)]
                    box = [(i + sigmoid(v[0])) / side, (j + sigmoid(v[1])) / side,
                           math.exp(v[2]) * biases[2 * n] / side,
                           math.exp(v[3]) * biases[2 * n + 1] / side]
                    scores = v[5:5 + classes]
                    e = [math.exp(s - max(scores)) for s in scores]
                    prob = [s / sum(e) for s in e]
                    best = prob.index(max(prob))
                    confidence = sigmoid(v[4]) * prob[best]
                    if confidence >= float(np.float32(threshold)):
                        predicts.append({'box': box, 'class': best, 'confidence': confidence})
    return fork_nms_rows(image, predicts, nms)


def yolov3_loop(bottoms, classes, num_box, biases, scales, mask, groups, threshold, nms,
                image):
    """Yolov3DetectionOutput's Forward_cpu for one image (correct_yolo_boxes with the
    network size of map x anchors_scale changes nothing and is left out)."""
    predicts = []
    length = 5 + classes
    for t, blob in enumerate(bottoms):
        _, _, height, width = blob.shape
        nw, nh = width * scales[t], height * scales[t]
        for s in range(width * height):
            y2, x2 = s // width, s % width
            for n in range(num_box):
                v = [blob[image, n * length + c, y2, x2] for c in range(length)]
                anchor = mask[n + t * groups]
                box = [(x2 + sigmoid(v[0])) / width, (y2 + sigmoid(v[1])) / height,
                       math.exp(v[2]) * biases[2 * anchor] / nw,
                       math.exp(v[3]) * biases[2 * anchor + 1] / nh]
                for c in range(classes):
                    score = sigmoid(v[5 + c]) * sigmoid(v[4])
                    if score > threshold:
                        predicts.append({'box': box, 'class': c, 'confidence': score})
    return fork_nms_rows(image, predicts, nms)


def rows_of(top):
    return top[0].data.reshape(-1, 7)


def check_rows(top, expected):
    got = rows_of(top)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)


YOLOV2 = ('name: "det" type: "YoloDetectionOutput" %s top: "out" yolo_detection_output_param '
          '{ num_classes: %d num_box: %d confidence_threshold: %g nms_threshold: %g %s }')
BIASES = [1.08, 1.19, 3.42, 4.41, 6.63, 11.38, 9.42, 5.11, 16.62, 10.52]


@pytest.mark.parametrize('sides, classes, num_box, threshold, nms', [
    ([13], 20, 5, 0.2, 0.45),          # MobileNet-YOLO's VOC setting, one scale
    ([5, 7], 3, 2, 0.05, 0.3),         # two scales, as its deploy nets' two bottoms
    ([4], 2, 3, 0.0, 0.0),             # every box; a zero threshold suppresses any touch
])
def test_yolov2_output_matches_the_forks_loop(sides, classes, num_box, threshold, nms):
    num = 2
    bottoms = [1.5 * RS.standard_normal((num, num_box * (5 + classes), side, side))
               for side in sides]
    biases = BIASES[:2 * num_box]
    stored = [float(np.float32(b)) for b in biases]        # the schema's floats
    names = ' '.join('bottom: "b%d"' % i for i in range(len(bottoms)))
    text = YOLOV2 % (names, classes, num_box, threshold, nms,
                     ' '.join('biases: %g' % b for b in biases))
    _, _, top = forward(text, bottoms)
    expected = [row for image in range(num)
                for row in yolov2_loop(bottoms, classes, num_box, stored, threshold,
                                       float(np.float32(nms)), image)]
    check_rows(top, np.array(expected))
    assert len(set(rows_of(top)[:, 0])) == num           # both images found something


YOLOV3 = ('name: "det" type: "Yolov3DetectionOutput" bottom: "a" bottom: "b" top: "out" '
          'yolov3_detection_output_param { num_classes: %d num_box: 3 confidence_threshold: '
          '%g nms_threshold: %g %s anchors_scale: 32 anchors_scale: 16 mask_group_num: 2 '
          'mask: 3 mask: 4 mask: 5 mask: 0 mask: 1 mask: 2 %s }')
V3_BIASES = [10, 14, 23, 27, 37, 58, 81, 82, 135, 169, 344, 319]


@pytest.mark.parametrize('classes, threshold, nms', [(20, 0.3, 0.45), (4, 0.01, 0.6)])
def test_yolov3_output_matches_the_forks_loop(classes, threshold, nms):
    num = 2
    bottoms = [RS.standard_normal((num, 3 * (5 + classes), side, side)) for side in (3, 6)]
    text = YOLOV3 % (classes, threshold, nms, ' '.join('biases: %g' % b for b in V3_BIASES), '')
    _, _, top = forward(text, bottoms)
    expected = [row for image in range(num)
                for row in yolov3_loop(bottoms, classes, 3, V3_BIASES, (32, 16),
                                       (3, 4, 5, 0, 1, 2), 3, float(np.float32(threshold)),
                                       float(np.float32(nms)), image)]
    check_rows(top, np.array(expected))


def test_yolov3_gaussian_boxes_scale_the_score_by_the_certainty():
    """gaussian_box: x, y, w, h at 0, 2, 4, 6, their uncertainties at 1, 3, 5, 7, the
    objectness at 8; a certain box (uncertainties far below 0) scores as plain YOLOv3."""
    classes = 2
    plain = RS.standard_normal((1, 3 * (5 + classes), 2, 2))
    gaussian = np.empty((1, 3 * (9 + classes), 2, 2))
    for n in range(3):
        p = plain[:, n * 7:(n + 1) * 7]
        g = gaussian[:, n * 11:(n + 1) * 11]
        g[:, [0, 2, 4, 6]] = p[:, :4]
        g[:, [1, 3, 5, 7]] = -60.0
        g[:, 8:] = p[:, 4:]
    text = ('name: "det" type: "Yolov3DetectionOutput" bottom: "a" top: "out" '
            'yolov3_detection_output_param { num_classes: 2 num_box: 3 confidence_threshold: '
            '0.05 biases: 10 biases: 14 biases: 23 biases: 27 biases: 37 biases: 58 '
            'anchors_scale: 32 mask_group_num: 1 mask: 0 mask: 1 mask: 2 %s }')
    _, _, top_plain = forward(text % '', [plain])
    _, _, top_gaussian = forward(text % 'gaussian_box: true', [gaussian])
    np.testing.assert_allclose(rows_of(top_gaussian), rows_of(top_plain), rtol=1e-12)
    for n in range(3):                       # mean uncertainty 1/2: every score halves
        gaussian[:, [n * 11 + k for k in (1, 3, 5, 7)]] = 0.0
    _, _, top_half = forward(text % 'gaussian_box: true', [gaussian])
    half = rows_of(top_half)
    full = {tuple(np.round(r[[1, 3, 4, 5, 6]], 12)): r[2] for r in rows_of(top_plain)}
    for row in half:
        assert np.isclose(row[2], full[tuple(np.round(row[[1, 3, 4, 5, 6]], 12))] / 2)


def test_nothing_found_gives_one_row_of_minus_one_per_image():
    bottoms = [np.full((3, 5 * 25, 2, 2), -20.0)]
    text = YOLOV2 % ('bottom: "b"', 20, 5, 0.2, 0.45, ' '.join('biases: %g' % b for b in BIASES))
    _, _, top = forward(text, bottoms)
    expected = np.full((3, 7), -1.0)
    expected[:, 0] = [0, 1, 2]
    check_rows(top, expected)


def test_nms_is_across_classes_and_keeps_the_better_box():
    """Two classes' boxes on one cell: the fork's NMS ignores the class, so the weaker
    box goes; NaN overlaps (two empty boxes) suppress nothing."""
    classes, num_box = 2, 2
    x = np.full((1, num_box * 7, 1, 1), -30.0)
    x[0, [0, 1, 7, 8], 0, 0] = 0.0                 # both boxes centred on the cell
    x[0, [2, 3, 9, 10], 0, 0] = 0.0                # anchors 1 x 1: the same box
    x[0, 4, 0, 0], x[0, 11, 0, 0] = 3.0, 2.0       # objectness: box 0 better
    x[0, 5, 0, 0], x[0, 13, 0, 0] = 5.0, 5.0       # box 0 says class 0, box 1 class 1
    text = YOLOV2 % ('bottom: "b"', classes, num_box, 0.1, 0.45,
                     'biases: 1 biases: 1 biases: 1 biases: 1')
    _, _, top = forward(text, [x])
    rows = rows_of(top)
    assert rows.shape == (1, 7) and rows[0, 1] == 1
    x[0, [2, 3, 9, 10], 0, 0] = -800.0             # sizes 0: overlap 0 / 0 = NaN
    _, _, top = forward(text, [x])
    assert rows_of(top).shape == (2, 7)


@pytest.mark.parametrize('text, bottoms, message', [
    (YOLOV2 % ('bottom: "b"', 20, 5, 0.2, 0.45, 'biases: 1 biases: 2'), [(1, 125, 2, 2)],
     '5 boxes need 10 biases (a width and a height each), got 2'),
    (YOLOV2 % ('bottom: "b"', 20, 5, 0.2, 0.45, ' '.join(['biases: 1'] * 10)), [(1, 120, 2, 2)],
     'bottom 0 must be (N, 125, H, W): 5 boxes of 25 values, got (1, 120, 2, 2)'),
    (YOLOV3 % (20, 0.1, 0.4, ' '.join('biases: %g' % b for b in V3_BIASES), ''),
     [(1, 75, 2, 2)], 'expects 2 bottom blob(s), got 1'),
    (YOLOV3 % (20, 0.1, 0.4, 'biases: 1 biases: 2', ''), [(1, 75, 2, 2), (1, 75, 4, 4)],
     'mask names anchor 5, but biases hold 1 anchors'),
])
def test_detection_output_bad_settings_are_one_line(text, bottoms, message):
    arrays = [RS.standard_normal(shape) for shape in bottoms]
    if 'Yolov3' in text and len(arrays) == 1:
        text = text.replace('bottom: "b" ', '')
    one_line(error_of(forward, text, arrays), 'det', message)
