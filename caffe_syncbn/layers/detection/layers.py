"""The SSD fork's detection layers: PriorBox, DetectionOutput and DetectionEvaluate.

They have no backward. DetectionOutput and DetectionEvaluate sort, suppress and match
boxes on the host (a few hundred candidates per image, one after another); the passes over
every prior or pair of boxes before that (decoding, overlaps) run on the engine chosen in
setup: gpu.py's kernels when the context runs CUDA kernels, else boxes.py's array
code. Both compute in float64, so the detections do not depend on the engine.
"""
import logging
import math

import numpy as np

from ...backend import to_numpy
from ...layer import Layer, register
from . import boxes as host_boxes, gpu as detection_gpu
from .boxes import CENTER_SIZE, CORNER, CORNER_SIZE, greedy_nms, in_type

log = logging.getLogger('caffe_syncbn')

_CODE_TYPES = {CORNER: 'CORNER', CENTER_SIZE: 'CENTER_SIZE', CORNER_SIZE: 'CORNER_SIZE'}


@register('PriorBox')
class PriorBoxLayer(Layer):
    """The default boxes of one feature map, for bottoms (feature map, image).

    Top (1, 2, H * W * boxes * 4): channel 0 holds, for each cell in row-major order,
    each min_size's boxes: the square of side min_size, the square of side
    sqrt(min_size * max_size) when max sizes are given, then one box per aspect ratio
    other than 1 (width min_size * sqrt(r), height min_size / sqrt(r)), as
    (xmin, ymin, xmax, ymax) divided by the image size; channel 1 holds their variances.
    """

    def full_precision_top(self, index):
        return True           # box coordinates, as the ground truth holds them

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, exact=1)
        p = self.param.prior_box_param
        if not p.min_size:
            raise self.error('prior_box_param needs at least one min_size')
        if any(size <= 0 for size in p.min_size):
            raise self.error('min_size must be positive, got %s' % list(p.min_size))
        if p.max_size and len(p.max_size) != len(p.min_size):
            raise self.error('%d max_size values for %d min_size values (expected one each)'
                             % (len(p.max_size), len(p.min_size)))
        for low, high in zip(p.min_size, p.max_size):
            if high <= low:
                raise self.error('max_size %g must be greater than its min_size %g'
                                 % (high, low))
        # the fork keeps sizes in int variables: 30.5 means 30
        self.min_sizes = [int(size) for size in p.min_size]
        self.max_sizes = [int(size) for size in p.max_size]
        self.aspect_ratios = [1.0]
        for ratio in p.aspect_ratio:
            if ratio <= 0:
                raise self.error('aspect_ratio must be positive, got %g' % ratio)
            if all(abs(ratio - known) >= 1e-6 for known in self.aspect_ratios):
                self.aspect_ratios.append(ratio)
                if p.flip:
                    self.aspect_ratios.append(1.0 / ratio)
        if len(p.variance) not in (0, 1, 4):
            raise self.error('variance takes 1 or 4 values, got %d' % len(p.variance))
        if any(v <= 0 for v in p.variance):
            raise self.error('variance must be positive, got %s' % list(p.variance))
        self.variance = list(p.variance) or [0.1]
        self.image_size = self._pair(p, 'img_size', 'img_h', 'img_w')
        self.step = self._pair(p, 'step', 'step_h', 'step_w')
        self.offset = p.offset
        self.boxes_per_cell = len(self.min_sizes) * len(self.aspect_ratios) + len(self.max_sizes)
        self.cached = None

    def _pair(self, p, both, height, width):
        """(height, width) from ``both`` or from ``height`` and ``width``; None if unset."""
        if p.HasField(height) or p.HasField(width):
            if p.HasField(both):
                raise self.error('set either %s or %s/%s, not both' % (both, height, width))
            pair = (getattr(p, height), getattr(p, width))
            names = (height, width)
        elif p.HasField(both):
            pair = (getattr(p, both),) * 2
            names = (both, both)
        else:
            return None
        for name, value in zip(names, pair):
            if value <= 0:
                raise self.error('%s must be positive, got %g' % (name, value))
        return pair

    def reshape(self, bottom, top):
        if bottom[0].num_axes < 2 or bottom[1].num_axes < 2:
            raise self.error('bottoms must be feature map and image blobs (N, C, H, W), '
                             'got shapes %s and %s' % (bottom[0].shape, bottom[1].shape))
        self.map_size = (bottom[0].height, bottom[0].width)
        self.image_shape = (bottom[1].height, bottom[1].width)
        top[0].reshape((1, 2, self.map_size[0] * self.map_size[1] * self.boxes_per_cell * 4))

    def _cell_boxes(self):
        """(boxes_per_cell, 2): the width and height of each box at a cell, in order."""
        sizes = []
        for i, min_size in enumerate(self.min_sizes):
            sizes.append((min_size, min_size))
            if self.max_sizes:
                side = math.sqrt(min_size * self.max_sizes[i])
                sizes.append((side, side))
            for ratio in self.aspect_ratios:
                if abs(ratio - 1.0) >= 1e-6:
                    root = math.sqrt(ratio)
                    sizes.append((min_size * root, min_size / root))
        return np.array(sizes, np.float64)

    def prior_boxes(self):
        map_h, map_w = self.map_size
        image_h, image_w = self.image_size or self.image_shape
        step_h, step_w = self.step or (image_h / map_h, image_w / map_w)
        center_y = (np.arange(map_h) + self.offset) * step_h
        center_x = (np.arange(map_w) + self.offset) * step_w
        sizes = self._cell_boxes()
        cy = center_y[:, None, None]
        cx = center_x[None, :, None]
        half_w, half_h = sizes[:, 0] / 2, sizes[:, 1] / 2
        boxes = np.stack(np.broadcast_arrays((cx - half_w) / image_w, (cy - half_h) / image_h,
                                             (cx + half_w) / image_w, (cy + half_h) / image_h),
                         axis=-1).reshape(-1)
        if self.param.prior_box_param.clip:
            boxes = np.clip(boxes, 0.0, 1.0)
        variances = np.resize(np.array(self.variance, np.float64), boxes.size)
        return np.stack([boxes, variances])[None]

    def forward(self, bottom, top):
        # the boxes depend only on the shapes: build them once per shape
        key = (self.map_size, self.image_shape)
        if self.cached is None or self.cached[0] != key:
            self.cached = (key, self.xp.asarray(self.prior_boxes().astype(self.dtype)))
        top[0].data[...] = self.cached[1]


@register('DetectionOutput')
class DetectionOutputLayer(Layer):
    """Boxes from bottoms (location offsets (N, priors * 4 [* classes]), class scores
    (N, priors * classes), PriorBox output (1, 2, priors * 4)): decoded, filtered by
    confidence_threshold, suppressed per class (NMS), then the keep_top_k best per image.

    The scores are used as they come: the net must apply its own Softmax (or Sigmoid);
    the boxes are not clipped to the image. Top (1, 1, detections, 7), rows
    [image, label, score, xmin, ymin, xmax, ymax] by image, then label, then score;
    when no image has a detection, one row [image, -1, -1, -1, -1, -1, -1] per image.

    RefineDet's two-step form adds the anchor refinement module's outputs: bottom 3 its
    objectness (N, priors * 2), softmax probabilities (background, object), and bottom 4
    its offsets (N, priors * 4). The priors are first moved by the ARM's offsets, and the
    location bottom's boxes decoded from them; a prior whose objectness is below
    ``objectness_score`` scores 1 for class 0 and 0 for every other class. A fourth
    bottom of another size is the SSD fork's image (read there only to visualize).
    """

    def full_precision_top(self, index):
        return True           # image indices, labels and box coordinates

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=3, maximum=5)
        self.check_tops(top, exact=1)
        p = self.param.detection_output_param
        if not p.HasField('num_classes'):
            raise self.error('detection_output_param needs num_classes')
        if p.num_classes < 1:
            raise self.error('num_classes must be positive, got %d' % p.num_classes)
        nms = p.nms_param
        if nms.nms_threshold < 0:
            raise self.error('nms_threshold must be >= 0, got %g' % nms.nms_threshold)
        if not 0 < nms.eta <= 1:
            raise self.error('eta must be in (0, 1], got %g' % nms.eta)
        if p.code_type not in _CODE_TYPES:
            raise self.error('unknown code_type %d' % p.code_type)
        if p.save_output_param.output_directory:      # every deploy net ssd_pascal.py writes
            log.warning("layer '%s': save_output_param.output_directory: the SSD fork's VOC or "
                        'COCO result files are not written here; the top holds the detections '
                        '(remove save_output_param to silence this)', self.name)
        if p.visualize:
            raise self.error('visualize: drawing the detections is not implemented: remove it '
                             'and read the top instead')
        self.num_classes = p.num_classes
        self.loc_classes = 1 if p.share_location else p.num_classes
        self.confidence_threshold = p.confidence_threshold \
            if p.HasField('confidence_threshold') else -np.inf
        self.top_k = nms.top_k if nms.HasField('top_k') else -1
        # the engine of the decoding, chosen once (NMS stays on the host: it is sequential)
        self.engine = detection_gpu if self.cuda_kernels else host_boxes

    def reshape(self, bottom, top):
        loc, conf, priors = bottom[:3]
        if loc.num != conf.num:
            raise self.error('location and confidence bottoms hold %d and %d items'
                             % (loc.num, conf.num))
        if priors.num_axes != 3 or priors.shape[:2] != (1, 2) or priors.shape[2] % 4:
            raise self.error('prior bottom must be PriorBox output (1, 2, priors * 4), got '
                             'shape %s' % (priors.shape,))
        self.num_priors = priors.shape[2] // 4
        want = self.num_priors * self.loc_classes * 4
        if loc.count_range(1) != want:
            raise self.error('%d location values per item for %d priors x %d x 4 '
                             '(expected %d)' % (loc.count_range(1), self.num_priors,
                                                self.loc_classes, want))
        want = self.num_priors * self.num_classes
        if conf.count_range(1) != want:
            raise self.error('%d confidence values per item for %d priors x %d classes '
                             '(expected %d)' % (conf.count_range(1), self.num_priors,
                                                self.num_classes, want))
        self.refine = self.refinement_bottoms(bottom)
        top[0].reshape((1, 1, 1, 7))        # the real size is known after the forward

    def refinement_bottoms(self, bottom):
        """How many of RefineDet's ARM bottoms (objectness, offsets) there are: 0 to 2."""
        p = self.param.detection_output_param
        arm = len(bottom) - 3
        if arm == 1 and not p.HasField('objectness_score') and \
                bottom[3].count_range(1) != 2 * self.num_priors:
            return 0                      # the SSD fork's image, which it reads to visualize
        if arm == 2 and not p.share_location:
            raise self.error("RefineDet's ARM offsets (bottom 4) need share_location: true")
        for index, per_prior, what in ((3, 2, 'ARM objectness'), (4, 4, 'ARM offsets'))[:arm]:
            if bottom[index].num != bottom[0].num or \
                    bottom[index].count_range(1) != per_prior * self.num_priors:
                raise self.error('%s (bottom %d) must hold %d values per item for %d priors '
                                 'x %d, got shape %s' % (what, index, per_prior * self.num_priors,
                                                         self.num_priors, per_prior,
                                                         bottom[index].shape))
        return arm

    def forward(self, bottom, top):
        p = self.param.detection_output_param
        num = bottom[0].num
        loc = bottom[0].data.astype(np.float64).reshape(num, self.num_priors,
                                                        self.loc_classes, 4)
        priors = bottom[2].data.astype(np.float64).reshape(2, self.num_priors, 4)
        if self.refine == 2:
            boxes = to_numpy(self.refined_boxes(loc, priors, bottom[4].data))
        else:
            boxes = to_numpy(self.engine.decode_all(loc, priors, p.code_type,
                                                    p.variance_encoded_in_target))
        conf = to_numpy(bottom[1].data).astype(np.float64).reshape(
            num, self.num_priors, self.num_classes)
        if self.refine:
            objectness = to_numpy(bottom[3].data).reshape(num, self.num_priors, 2)[..., 1]
            background = objectness < p.objectness_score
            conf[background] = 0.0
            conf[background, 0] = 1.0       # class 0, whatever background_label_id says
        rows = []
        for item in range(num):
            rows += self._detections(item, [boxes[item, :, c] for c in range(self.loc_classes)],
                                     conf[item])
        if rows:
            result = np.array(rows, np.float64)
        else:
            result = np.full((num, 7), -1.0)
            result[:, 0] = np.arange(num)
        top[0].reshape((1, 1) + result.shape)
        top[0].data[...] = self.xp.asarray(in_type(result, self.dtype))

    def refined_boxes(self, loc, priors, arm_offsets):
        """The boxes ``loc`` predicts from the priors that the ARM's offsets moved, per
        image (the moved priors keep their variances)."""
        p = self.param.detection_output_param
        xp = self.xp
        num = loc.shape[0]
        moved = self.engine.decode_all(arm_offsets.astype(np.float64).reshape(
            num, self.num_priors, 1, 4), priors, p.code_type, p.variance_encoded_in_target)
        return xp.concatenate([
            self.engine.decode_all(loc[item:item + 1], xp.stack([moved[item, :, 0],
                                                                 priors[1]]),
                                   p.code_type, p.variance_encoded_in_target)
            for item in range(num)])

    def _detections(self, item, boxes, scores):
        """The rows of one image: NMS per class, then the keep_top_k best."""
        p = self.param.detection_output_param
        kept = {}
        for label in range(self.num_classes):
            if label == p.background_label_id:
                continue
            label_boxes = boxes[0 if p.share_location else label]
            kept[label] = greedy_nms(label_boxes, scores[:, label], self.confidence_threshold,
                                     p.nms_param.nms_threshold, p.nms_param.eta, self.top_k)
        total = sum(len(indices) for indices in kept.values())
        if -1 < p.keep_top_k < total:
            ranked = sorted(((scores[index, label], label, index)
                             for label, indices in kept.items() for index in indices),
                            key=lambda entry: -entry[0])[:p.keep_top_k]
            kept = {}
            for _, label, index in ranked:
                kept.setdefault(label, []).append(index)
        rows = []
        for label in sorted(kept):
            label_boxes = boxes[0 if p.share_location else label]
            for index in kept[label]:
                rows.append([item, label, scores[index, label]] + list(label_boxes[index]))
        return rows


@register('DetectionEvaluate')
class DetectionEvaluateLayer(Layer):
    """True and false positives of detections (1, 1, D, 7), as DetectionOutput writes
    them, against ground truth (1, 1, G, 8) rows [image, label, instance, xmin, ymin,
    xmax, ymax, difficult] (a row with image -1 ends the list), in normalized coordinates.

    Top (1, 1, classes + detections, 5): first [-1, label, ground-truth count, -1, -1]
    for each label but the background, then [image, label, score, tp, fp] per detection
    (by image and label; by score where the label has ground truth). A detection is a
    true positive when its best overlap (the first best ground-truth box) reaches
    overlap_threshold and that box was not matched by a better detection; one that
    matches a difficult box while evaluate_difficult_gt is false is neither (0, 0).
    ``caffe_syncbn.layers.detection.boxes.detection_map`` turns the tops into the mAP.
    """

    def full_precision_top(self, index):
        return True           # counts, labels and scores

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, exact=1)
        p = self.param.detection_evaluate_param
        if not p.HasField('num_classes'):
            raise self.error('detection_evaluate_param needs num_classes')
        if p.overlap_threshold <= 0:
            raise self.error('overlap_threshold must be positive, got %g' % p.overlap_threshold)
        if p.name_size_file:
            raise self.error('name_size_file (evaluation in pixels of the original images) '
                             'is not supported: boxes are compared in normalized coordinates')
        # the engine of the overlaps, chosen once (the matching in score order stays on the host)
        self.engine = detection_gpu if self.cuda_kernels else host_boxes

    def reshape(self, bottom, top):
        detections, truth = bottom
        for blob, width, what in ((detections, 7, 'detection'), (truth, 8, 'ground-truth')):
            if blob.num_axes != 4 or blob.shape[:2] != (1, 1) or blob.shape[3] != width:
                raise self.error('%s bottom must have shape (1, 1, rows, %d), got %s'
                                 % (what, width, blob.shape))
        p = self.param.detection_evaluate_param
        labels = p.num_classes - (0 if p.background_label_id == -1 else 1)
        valid = int(np.count_nonzero(to_numpy(detections.data)[0, 0, :, 1] != -1))
        top[0].reshape((1, 1, labels + valid, 5))

    def forward(self, bottom, top):
        p = self.param.detection_evaluate_param
        detections = to_numpy(bottom[0].data).astype(np.float64)[0, 0]
        truth = to_numpy(bottom[1].data).astype(np.float64)[0, 0]
        ends = np.flatnonzero(truth[:, 0].astype(np.int64) == -1)
        truth = truth[:ends[0]] if ends.size else truth
        # every detection against every ground-truth box, in one pass of the engine
        iou = to_numpy(self.engine.overlap_matrix(
            bottom[0].data[0, 0, :, 3:7].astype(np.float64),
            bottom[1].data[0, 0, :len(truth), 3:7].astype(np.float64)))
        # rows [image, -1, ...] are DetectionOutput's "nothing found" markers
        for rows, what in ((detections, 'detection'), (truth, 'ground-truth')):
            labels = rows[rows[:, 0].astype(np.int64) != -1, 1].astype(np.int64)
            if what == 'detection':
                labels = labels[labels != -1]
            if np.any(labels == p.background_label_id):
                raise self.error('a %s row has the background label %d'
                                 % (what, p.background_label_id))
        difficult = truth[:, 7].astype(bool)
        out = np.zeros(top[0].shape[2:], np.float64)
        row = 0
        for label in range(p.num_classes):
            if label == p.background_label_id:
                continue
            mine = truth[:, 1].astype(np.int64) == label
            count = np.count_nonzero(mine if p.evaluate_difficult_gt else mine & ~difficult)
            out[row] = [-1, label, count, -1, -1]
            row += 1
        images = detections[:, 0].astype(np.int64)
        labels = detections[:, 1].astype(np.int64)
        for image in sorted(set(images[(images != -1) & (labels != -1)].tolist())):
            for label in sorted(set(labels[(images == image) & (labels != -1)].tolist())):
                found = np.flatnonzero((images == image) & (labels == label))
                gt_rows = np.flatnonzero((truth[:, 0].astype(np.int64) == image)
                                         & (truth[:, 1].astype(np.int64) == label))
                if not gt_rows.size:
                    for det in found:
                        out[row] = [image, label, detections[det, 2], 0, 1]
                        row += 1
                    continue
                gt_difficult = difficult[gt_rows]
                matched = np.zeros(len(gt_rows), bool)
                for det in found[np.argsort(-detections[found, 2], kind='stable')]:
                    out[row, :3] = [image, label, detections[det, 2]]
                    ious = iou[det, gt_rows]
                    best = int(np.argmax(ious))
                    if ious[best] < p.overlap_threshold:
                        out[row, 3:] = [0, 1]
                    elif p.evaluate_difficult_gt or not gt_difficult[best]:
                        out[row, 3:] = [0, 1] if matched[best] else [1, 0]
                        matched[best] = True
                    row += 1
        top[0].data[...] = self.xp.asarray(out.astype(self.dtype))
