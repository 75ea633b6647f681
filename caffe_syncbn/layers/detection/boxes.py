"""Box arithmetic of the SSD layers, on host numpy arrays of (xmin, ymin, xmax, ymax) rows.

Nothing here is a layer. ``decode_all`` and ``overlap_matrix`` are the host engine of the
passes over every prior; gpu.py is the CUDA one, with the same signatures (arrays of the
layer's array module in, of that module out: here, host arrays in their own dtype). The
rules are the SSD fork's, traps included (they are listed in docs/detection.md): sizes of
inverted boxes are 0, overlaps touch-at-an-edge are 0, the greedy NMS can shrink its
threshold (eta), and the average precision of a class is computed in float32 from float32
recall values compared with float64 thresholds, exactly as the fork's solver does.
"""
import numpy as np

from ...backend import to_numpy

CORNER, CENTER_SIZE, CORNER_SIZE = 1, 2, 3       # PriorBoxParameter.CodeType
AP_VERSIONS = ('11point', 'MaxIntegral', 'Integral')


# ---- IEEE arithmetic without its flags ----------------------------------------------------
# An untrained or diverged net can predict log-sizes past exp's range. IEEE arithmetic, the
# fork's and the CUDA engine's, then gives infinite boxes, inf areas, NaN for inf x 0 and
# inf - inf, and NMS acts on those values (an infinite box that overlaps another over an
# infinite length has overlap NaN, and is suppressed). These functions give the same
# values, computed so that no step overflows.

def _exp(x):
    """exp(x) in x's type: +inf past its range, as C's expf and exp give it."""
    beyond = x > _log_max(x.dtype)
    return np.where(beyond, np.inf, np.exp(np.where(beyond, 0, x))).astype(x.dtype)


def _log_max(dtype):
    """The largest x of ``dtype`` whose exp is finite."""
    exact = np.log(float(np.finfo(dtype).max))
    limit = np.asarray(exact, dtype)
    return np.nextafter(limit, dtype.type(0)) if float(limit) > exact else limit


def _product(a, b):
    """a * b of sizes (>= 0 where the caller uses it): +inf past the range, NaN for inf x 0."""
    top = np.finfo(np.result_type(a, b)).max
    a, b = np.abs(a), np.abs(b)
    undefined = (np.isinf(a) & (b == 0)) | ((a == 0) & np.isinf(b))
    beyond = ~undefined & (b > top / np.maximum(a, 1))
    plain = np.where(undefined | beyond, 0, a) * np.where(undefined | beyond, 0, b)
    return np.where(undefined, np.nan, np.where(beyond, np.inf, plain))


def _union(size, sizes, intersection):
    """size + sizes - intersection: NaN where the intersection is infinite (inf - inf),
    +inf past the range."""
    top = np.finfo(np.result_type(size, sizes, intersection)).max
    infinite = np.isinf(intersection)
    rest = np.where(infinite, 0, size) - np.where(infinite, 0, intersection)
    beyond = ~infinite & (sizes > top - rest)
    total = np.where(beyond | infinite, 0, rest) + np.where(beyond | infinite, 0, sizes)
    return np.where(infinite, np.nan, np.where(beyond, np.inf, total))


def in_type(values, dtype):
    """``values`` (float64) as ``dtype``: past its range they are +-inf, as the cast gives them
    (DetectionOutput decodes in float64 on both engines; its top is the net's type)."""
    beyond = np.abs(values) > np.finfo(dtype).max
    return np.where(beyond, np.copysign(np.inf, values), values).astype(dtype)


# ---- boxes --------------------------------------------------------------------------------
def box_sizes(boxes):
    """Areas of (..., 4) boxes; 0 for a box with xmax < xmin or ymax < ymin."""
    width = boxes[..., 2] - boxes[..., 0]
    height = boxes[..., 3] - boxes[..., 1]
    return np.where((width < 0) | (height < 0), 0.0, _product(width, height))


def overlaps(box, boxes):
    """Jaccard overlap (intersection over union) of one box with each row of ``boxes``;
    0 where they do not overlap with a positive width and height."""
    width = np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0])
    height = np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1])
    inside = (width > 0) & (height > 0)
    intersection = np.where(inside, _product(width, height), 0.0)
    union = _union(box_sizes(box), box_sizes(boxes), intersection)
    return np.where(inside, intersection / np.where(inside, union, 1.0), 0.0)


def overlap_matrix(boxes, others):
    """Jaccard overlaps (len(boxes), len(others)) of two sets of corner boxes; 0 where
    the intersection has no positive width and height."""
    boxes, others = to_numpy(boxes), to_numpy(others)
    width = (np.minimum(boxes[:, None, 2], others[None, :, 2])
             - np.maximum(boxes[:, None, 0], others[None, :, 0]))
    height = (np.minimum(boxes[:, None, 3], others[None, :, 3])
              - np.maximum(boxes[:, None, 1], others[None, :, 1]))
    inside = (width > 0) & (height > 0)
    intersection = np.where(inside, _product(width, height), 0)
    union = _union(box_sizes(boxes)[:, None], box_sizes(others)[None, :], intersection)
    return np.where(inside, intersection / np.where(inside, union, 1), 0)


def decode_all(loc, prior_data, code_type, variance_encoded_in_target):
    """Boxes (num, P, L, 4) that offsets ``loc`` (num, P, L, 4) predict from ``prior_data``
    (2, P, 4): PriorBox's boxes and variances (L: 1 when the classes share locations)."""
    loc, prior_data = to_numpy(loc), to_numpy(prior_data)
    per_box = [np.broadcast_to(part[None, :, None], loc.shape).reshape(-1, 4)
               for part in prior_data]
    return decode_boxes(per_box[0], per_box[1], loc.reshape(-1, 4), code_type,
                        variance_encoded_in_target).reshape(loc.shape)


def decode_boxes(priors, variances, offsets, code_type, variance_encoded_in_target):
    """The boxes that ``offsets`` (P, 4) predict relative to ``priors`` (P, 4), whose
    ``variances`` (P, 4) scale the offsets unless the targets already include them."""
    if not variance_encoded_in_target:
        offsets = offsets * variances
    if code_type == CORNER:
        return priors + offsets
    prior_width = priors[:, 2] - priors[:, 0]
    prior_height = priors[:, 3] - priors[:, 1]
    if code_type == CORNER_SIZE:
        return priors + offsets * np.stack([prior_width, prior_height] * 2, axis=1)
    center_x = offsets[:, 0] * prior_width + (priors[:, 0] + priors[:, 2]) / 2
    center_y = offsets[:, 1] * prior_height + (priors[:, 1] + priors[:, 3]) / 2
    half_width = _exp(offsets[:, 2]) * prior_width / 2
    half_height = _exp(offsets[:, 3]) * prior_height / 2
    return np.stack([center_x - half_width, center_y - half_height,
                     center_x + half_width, center_y + half_height], axis=1)


def greedy_nms(boxes, scores, score_threshold, nms_threshold, eta, top_k):
    """Indices of the boxes kept, best first: candidates score above ``score_threshold``
    (the ``top_k`` best when top_k >= 0; equal scores keep index order); a candidate is
    kept when its overlap with every kept box is at most the threshold, which after each
    kept box is multiplied by ``eta`` while it is above 0.5."""
    candidates = np.flatnonzero(scores > score_threshold)
    candidates = candidates[np.argsort(-scores[candidates], kind='stable')]
    if top_k >= 0:
        candidates = candidates[:top_k]
    kept = []
    threshold = nms_threshold
    for index in candidates:
        if kept and not np.all(overlaps(boxes[index], boxes[kept]) <= threshold):
            continue
        kept.append(int(index))
        if eta < 1 and threshold > 0.5:
            threshold *= eta
    return kept


def average_precision(scored_true_pos, num_pos, ap_version):
    """A class's average precision from (score, 1 for a true / 0 for a false positive)
    pairs in the order they were produced, and its number of ground-truth boxes.

    ``ap_version``: '11point' (VOC2007: the mean of the best precision at recall >= 0,
    0.1, ..., 1), 'MaxIntegral' (the area under the precision envelope, where the
    step from recall r_i to r_i+1 takes the best precision at i or later), 'Integral'
    (the plain area under the precision/recall steps).
    """
    if ap_version not in AP_VERSIONS:
        raise ValueError('unknown ap_version %r (expected one of %s)'
                         % (ap_version, ', '.join(AP_VERSIONS)))
    if not scored_true_pos or num_pos == 0:
        return 0.0
    scores = np.array([score for score, _ in scored_true_pos], np.float32)
    hits = np.array([hit for _, hit in scored_true_pos], np.int64)
    order = np.argsort(-scores, kind='stable')
    true_pos = np.cumsum(hits[order])
    false_pos = np.cumsum(1 - hits[order])
    precision = (true_pos / (true_pos + false_pos)).astype(np.float32)
    recall = (true_pos / num_pos).astype(np.float32)
    f32 = np.float32
    eps = f32(1e-6)
    ap = f32(0)
    if ap_version == '11point':
        for level in range(10, -1, -1):    # the fork's order of float32 sums
            reached = recall.astype(np.float64) >= level / 10.0
            best = precision[reached].max() if reached.any() else f32(0)
            ap = f32(ap + f32(best) / f32(11))
    elif ap_version == 'MaxIntegral':
        current_recall, current_precision = recall[-1], precision[-1]
        for i in range(len(recall) - 2, -1, -1):
            current_precision = max(precision[i], current_precision)
            step = abs(f32(current_recall - recall[i]))
            if step > eps:
                ap = f32(ap + f32(current_precision * step))
            current_recall = recall[i]
        ap = f32(ap + f32(current_recall * current_precision))
    else:
        previous_recall = f32(0)
        for i in range(len(recall)):
            step = abs(f32(recall[i] - previous_recall))
            if step > eps:
                ap = f32(ap + f32(precision[i] * step))
            previous_recall = recall[i]
    return float(ap)


def detection_map(evaluations, ap_version='Integral'):
    """(mean AP, {label: AP}) of DetectionEvaluate tops (arrays of (..., 5) rows), as
    many as there were test iterations.

    Rows with image id -1 count ground-truth boxes per label; the others are
    detections, and a row that is neither a true nor a false positive (it matched a
    difficult box that is not evaluated) is skipped. The mean is over every label
    with a count row, so a label with no ground truth in the test set adds an AP of 0.
    """
    num_pos, scored = {}, {}
    for evaluation in evaluations:
        for image_id, label, value, true_pos, false_pos in np.asarray(evaluation).reshape(-1, 5):
            label = int(label)
            if int(image_id) == -1:
                num_pos[label] = num_pos.get(label, 0) + int(value)
            elif int(true_pos) or int(false_pos):
                scored.setdefault(label, []).append((float(value), int(true_pos)))
    aps = {label: average_precision(scored.get(label, []), count, ap_version)
           for label, count in sorted(num_pos.items())}
    total = np.float32(0)
    for ap in aps.values():
        total = np.float32(total + np.float32(ap))
    return (float(total / np.float32(len(aps))) if aps else 0.0), aps
