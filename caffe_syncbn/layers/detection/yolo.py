"""eric612/MobileNet-YOLO's detection outputs: YoloDetectionOutput (YOLOv2) and
Yolov3DetectionOutput, decoding and non-maximum suppression as the fork does them
(docs/detection.md, "The YOLO ports").

Both decode every box of every cell on the host in float64, keep the candidates whose
confidence passes the threshold, sort them by confidence and suppress, over all classes
at once, every candidate whose overlap with a better kept one is at least
``nms_threshold``. Rows are [image, label + 1, confidence, xmin, ymin, xmax, ymax] in the
input's fraction, not clipped. The fork gathers the candidates of the whole batch in one
list and writes image 0 on every row; here each image is suppressed on its own and its
rows carry its index (the same rows for a batch of one).
"""
import numpy as np

from ...backend import to_numpy
from ...layer import Layer, register
from .boxes import in_type


def _logistic(x):
    return 1 / (1 + np.exp(-x))


def center_overlaps(box, boxes):
    """Intersection over union of one (x, y, w, h) box with each row of ``boxes``, as the
    fork's box_iou: an intersection with a negative side is 0; 0 / 0 is NaN, which
    suppresses nothing."""
    def side(center, extent, centers, extents):
        return (np.minimum(center + extent / 2, centers + extents / 2)
                - np.maximum(center - extent / 2, centers - extents / 2))
    width = side(box[0], box[2], boxes[:, 0], boxes[:, 2])
    height = side(box[1], box[3], boxes[:, 1], boxes[:, 3])
    intersection = np.where((width < 0) | (height < 0), 0.0, width * height)
    with np.errstate(invalid='ignore', divide='ignore'):
        return intersection / (box[2] * box[3] + boxes[:, 2] * boxes[:, 3] - intersection)


def suppress(boxes, confidences, threshold):
    """Indices of the candidates kept, best first: sorted by confidence (equal ones in
    their order), each suppresses the later ones it overlaps by ``threshold`` or more."""
    order = np.argsort(-confidences, kind='stable')
    boxes = boxes[order]
    alive = np.ones(len(order), bool)
    for i in range(len(order)):
        if alive[i]:
            later = np.arange(i + 1, len(order))[alive[i + 1:]]
            alive[later[center_overlaps(boxes[i], boxes[later]) >= threshold]] = False
    return order[alive]


def detection_rows(num, per_image):
    """The top's (detections, 7) rows from each image's (boxes (K, 4) as x, y, w, h,
    labels (K,), confidences (K,)) after suppression; one row of -1 per image when no
    image has a detection."""
    rows = []
    for image, (boxes, labels, confidences) in enumerate(per_image):
        if len(boxes):
            corners = np.concatenate([boxes[:, :2] - boxes[:, 2:] / 2,
                                      boxes[:, :2] + boxes[:, 2:] / 2], axis=1)
            rows.append(np.column_stack([np.full(len(boxes), image), labels + 1,
                                         confidences, corners]))
    if rows:
        return np.concatenate(rows)
    empty = np.full((num, 7), -1.0)
    empty[:, 0] = np.arange(num)
    return empty


class _YoloOutput(Layer):
    """What both outputs share: the top's shape, the suppression and the rows."""

    def reshape(self, bottom, top):
        for index, blob in enumerate(bottom):
            if blob.num_axes != 4 or blob.shape[1] != self.channels:
                raise self.error('bottom %d must be (N, %d, H, W): %d boxes of %d values, '
                                 'got %s' % (index, self.channels, self.num_box,
                                             self.channels // self.num_box, blob.shape))
            if blob.shape[0] != bottom[0].shape[0]:
                raise self.error('the bottoms hold %d and %d images'
                                 % (bottom[0].shape[0], blob.shape[0]))
        top[0].reshape((1, 1, 1, 7))          # the real size is known after the forward

    def forward(self, bottom, top):
        num = bottom[0].shape[0]
        decoded = [self.decode(index, to_numpy(blob.data).astype(np.float64))
                   for index, blob in enumerate(bottom)]
        per_image = []
        for image in range(num):
            boxes, labels, confidences = (np.concatenate([scale[part][image]
                                                          for scale in decoded])
                                          for part in range(3))
            kept = suppress(boxes, confidences, self.nms_threshold)
            per_image.append((boxes[kept], labels[kept], confidences[kept]))
        rows = detection_rows(num, per_image)
        top[0].reshape((1, 1) + rows.shape)
        top[0].data[...] = self.xp.asarray(in_type(rows, self.dtype))

    def cell_boxes(self, offsets, anchors, divisors):
        """(x, y, w, h) of every (image, cell, box) from raw ``offsets`` (..., 4) of a map
        (N, H * W, boxes, 4): centres from the logistic of x and y plus the cell's column
        and row over the map's width and height, sizes from the exponential times the
        anchors (boxes, 2) over ``divisors`` (width, height)."""
        height, width = self.map_size
        cells = np.arange(height * width)
        column = (cells % width)[None, :, None]
        row = (cells // width)[None, :, None]
        return np.stack([(column + _logistic(offsets[..., 0])) / width,
                         (row + _logistic(offsets[..., 1])) / height,
                         np.exp(offsets[..., 2]) * anchors[:, 0] / divisors[0],
                         np.exp(offsets[..., 3]) * anchors[:, 1] / divisors[1]], axis=-1)

    def by_box(self, values):
        """(N, C, H, W) as (N, H * W, boxes, C / boxes), cell by cell."""
        num, channels, height, width = values.shape
        self.map_size = (height, width)
        return values.reshape(num, self.num_box, channels // self.num_box,
                              height * width).transpose(0, 3, 1, 2)


@register('YoloDetectionOutput')
class YoloDetectionOutputLayer(_YoloOutput):
    """YOLOv2: bottoms (N, boxes * (5 + classes), H, W), one per scale (the fork reads
    two at most), every scale with the same anchors (``biases``, in cells). A box's
    confidence is the logistic of its objectness times its best class's softmax
    probability; it is kept when it reaches ``confidence_threshold``."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=1, maximum=2)
        self.check_tops(top, exact=1)
        p = self.param.yolo_detection_output_param
        if not p.HasField('num_classes') or p.num_classes < 1:
            raise self.error('yolo_detection_output_param needs num_classes >= 1')
        if p.num_box < 1 or len(p.biases) < 2 * p.num_box:
            raise self.error('%d boxes need %d biases (a width and a height each), got %d'
                             % (p.num_box, 2 * p.num_box, len(p.biases)))
        self.num_box, self.num_classes = p.num_box, p.num_classes
        self.channels = p.num_box * (5 + p.num_classes)
        self.anchors = np.array(p.biases[:2 * p.num_box], np.float64).reshape(-1, 2)
        self.threshold, self.nms_threshold = p.confidence_threshold, p.nms_threshold

    def decode(self, index, values):
        by_box = self.by_box(values)
        height, width = self.map_size
        boxes = self.cell_boxes(by_box[..., :4], self.anchors, (width, height))
        scores = by_box[..., 5:5 + self.num_classes]
        prob = np.exp(scores - scores.max(axis=-1, keepdims=True))
        prob /= prob.sum(axis=-1, keepdims=True)
        labels = np.argmax(prob, axis=-1)
        confidences = _logistic(by_box[..., 4]) * prob.max(axis=-1)
        kept = confidences >= self.threshold
        return ([boxes[i][kept[i]] for i in range(len(boxes))],
                [labels[i][kept[i]] for i in range(len(boxes))],
                [confidences[i][kept[i]] for i in range(len(boxes))])


@register('Yolov3DetectionOutput')
class Yolov3DetectionOutputLayer(_YoloOutput):
    """YOLOv3: one bottom per scale, (N, boxes * (5 + classes), H, W), or with
    ``gaussian_box`` (N, boxes * (9 + classes), H, W). Box n of bottom t takes the
    anchor ``mask[n + t * len(mask) / mask_group_num]`` of ``biases`` (in input pixels;
    the input is the map's size times ``anchors_scale[t]``). Each class whose logistic
    times the objectness's is above ``confidence_threshold`` makes a candidate."""

    def setup(self, bottom, top):
        p = self.param.yolov3_detection_output_param
        if p.mask_group_num < 1:
            raise self.error('mask_group_num must be at least 1, got %d' % p.mask_group_num)
        self.check_bottoms(bottom, exact=p.mask_group_num)
        self.check_tops(top, exact=1)
        if p.num_classes < 1 or p.num_box < 1:
            raise self.error('yolov3_detection_output_param needs num_classes and num_box '
                             '>= 1, got %d and %d' % (p.num_classes, p.num_box))
        if len(p.anchors_scale) < len(bottom):
            raise self.error('%d bottoms need %d anchors_scale values, got %d'
                             % (len(bottom), len(bottom), len(p.anchors_scale)))
        group = len(p.mask) // p.mask_group_num
        last = p.num_box - 1 + (len(bottom) - 1) * group
        if last >= len(p.mask):
            raise self.error('%d boxes on %d bottoms read mask[%d], but mask has %d values'
                             % (p.num_box, len(bottom), last, len(p.mask)))
        anchors = np.array(p.biases, np.float64)
        if any(2 * m + 1 >= len(anchors) for m in p.mask):
            raise self.error('mask names anchor %d, but biases hold %d anchors'
                             % (max(p.mask), len(anchors) // 2))
        self.num_box, self.num_classes, self.gaussian = p.num_box, p.num_classes, p.gaussian_box
        self.channels = p.num_box * ((9 if self.gaussian else 5) + p.num_classes)
        self.anchors = [anchors[[2 * m + k for m in p.mask[t * group:t * group + p.num_box]
                                 for k in (0, 1)]].reshape(-1, 2) for t in range(len(bottom))]
        self.scales = list(p.anchors_scale)
        self.threshold, self.nms_threshold = p.confidence_threshold, p.nms_threshold

    def decode(self, index, values):
        by_box = self.by_box(values)
        height, width = self.map_size
        scale = self.scales[index]
        divisors = (width * scale, height * scale)
        if self.gaussian:
            # x, y, w, h at 0, 2, 4, 6 with their uncertainties at 1, 3, 5, 7; the score
            # is scaled by one minus their mean (Gaussian YOLOv3)
            offsets = by_box[..., [0, 2, 4, 6]]
            certainty = 1 - _logistic(by_box[..., [1, 3, 5, 7]]).mean(axis=-1)
            objectness = _logistic(by_box[..., 8]) * certainty
            classes = by_box[..., 9:]
        else:
            offsets, objectness, classes = by_box[..., :4], _logistic(by_box[..., 4]), \
                by_box[..., 5:]
        boxes = self.cell_boxes(offsets, self.anchors[index], divisors)
        scores = _logistic(classes) * objectness[..., None]
        found = [np.nonzero(scores[i] > self.threshold) for i in range(len(scores))]
        return ([boxes[i][cell, box] for i, (cell, box, _) in enumerate(found)],
                [label for _, _, label in found],
                [scores[i][hit] for i, hit in enumerate(found)])
