"""Matching of prior boxes to ground truth, target encoding and negative mining of the
MultiBoxLoss layer, per image, on host numpy arrays, at the SSD fork's rules.

A match is an int array over the priors: the index of the matched ground-truth box,
-1 for none, -2 for a prior ignored because it crosses the image boundary. A layer
that matches per class keeps one such array per class label, in label order; one that
shares locations keeps it under label -1.
"""
import numpy as np

from .boxes import CENTER_SIZE, CORNER, CORNER_SIZE

UNMATCHED, IGNORED = -1, -2
#: overlaps at or below this are no overlap at all for the matching
MIN_OVERLAP = 1e-6
FLT_MIN = float(np.finfo(np.float32).tiny)   # the softmax loss clamps log() here


def crosses_boundary(boxes):
    return np.any((boxes < 0) | (boxes > 1), axis=1)


def match_boxes(iou, ignored, per_prediction, overlap_threshold):
    """(match, best overlap) of each prediction box, from ``iou`` (predictions, ground
    truths), the engine's overlap_matrix; ``ignored`` (a mask over the predictions, or None)
    leaves predictions out of the matching.

    Bipartite first: the most overlapping (prediction, ground truth) pair among the
    unmatched ones is matched, until every ground truth has a prediction or none
    overlaps; ties go to the lower prediction index, then the lower ground-truth index.
    With ``per_prediction`` every prediction still unmatched then takes its most
    overlapping ground truth if that overlap reaches ``overlap_threshold``. The best
    overlap of a prediction counts every ground truth, matched or not.

    The loop stays on the host on every engine: each pick removes a row and a column that
    the next pick must not take, so the picks are sequential (at most one per ground truth).
    """
    count = len(iou)
    match = np.full(count, UNMATCHED, np.int64)
    best_overlap = np.zeros(count, iou.dtype)
    if iou.shape[1] == 0:
        return match, best_overlap
    iou = np.where(iou > MIN_OVERLAP, iou, 0)
    if ignored is not None:
        match[ignored] = IGNORED
        iou[ignored] = 0
    best_overlap[:] = iou.max(axis=1)
    candidates = np.where(iou > 0, iou, -1)
    for _ in range(iou.shape[1]):
        pred, gt = np.unravel_index(np.argmax(candidates), candidates.shape)
        if candidates[pred, gt] < 0:
            break
        match[pred] = gt
        best_overlap[pred] = iou[pred, gt]
        candidates[pred, :] = -1
        candidates[:, gt] = -1
    if per_prediction:
        eligible = np.where((iou > 0) & (iou >= overlap_threshold), iou, -1)
        best_gt = np.argmax(eligible, axis=1)
        best = eligible[np.arange(count), best_gt]
        take = (match == UNMATCHED) & (best >= 0)
        match[take] = best_gt[take]
        best_overlap[take] = best[take]
    return match, best_overlap


def encode_boxes(priors, variances, boxes, code_type, variance_in_target):
    """The offsets of ``boxes`` (P, 4) relative to ``priors`` (P, 4): the inverse of
    boxes.decode_boxes; ``variances`` divide them unless ``variance_in_target``."""
    if code_type == CORNER:
        offsets = boxes - priors
    else:
        prior_width = priors[:, 2] - priors[:, 0]
        prior_height = priors[:, 3] - priors[:, 1]
        if code_type == CORNER_SIZE:
            offsets = (boxes - priors) / np.stack([prior_width, prior_height] * 2, axis=1)
        elif code_type == CENTER_SIZE:
            width = boxes[:, 2] - boxes[:, 0]
            height = boxes[:, 3] - boxes[:, 1]
            center_x = (boxes[:, 0] + boxes[:, 2]) / 2 - (priors[:, 0] + priors[:, 2]) / 2
            center_y = (boxes[:, 1] + boxes[:, 3]) / 2 - (priors[:, 1] + priors[:, 3]) / 2
            offsets = np.stack([center_x / prior_width, center_y / prior_height,
                                np.log(width / prior_width), np.log(height / prior_height)],
                               axis=1)
        else:
            raise ValueError('unknown code_type %r' % code_type)
    return offsets if variance_in_target else offsets / variances


def softmax_losses(scores, labels):
    """-log softmax(score)[label] of each row, clamped like the fork's softmax loss."""
    shifted = scores - scores.max(axis=1, keepdims=True)
    prob = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    picked = prob[np.arange(len(scores)), labels]
    return -np.log(np.maximum(picked, FLT_MIN)), prob


def logistic_losses(scores, targets):
    """Sigmoid cross-entropy of each row, summed over its classes (numerically stable)."""
    positive = (scores >= 0).astype(scores.dtype)
    terms = scores * (targets - positive) - np.log1p(np.exp(scores - 2 * scores * positive))
    return -terms.sum(axis=1)


def loc_losses(differences, smooth_l1):
    """Per-row loss of (rows, 4) offset differences: smooth L1 or half the squared L2."""
    magnitude = np.abs(differences)
    if smooth_l1:
        terms = np.where(magnitude < 1, 0.5 * differences ** 2, magnitude - 0.5)
    else:
        terms = 0.5 * differences ** 2
    return terms.sum(axis=1)


def loc_gradients(differences, smooth_l1):
    if smooth_l1:
        return np.where(np.abs(differences) < 1, differences, np.sign(differences))
    return differences


def select_examples(losses, eligible, count):
    """Indices of the ``count`` eligible priors with the highest loss (the order of equal
    losses is the lower index first)."""
    indices = np.flatnonzero(eligible)
    order = indices[np.argsort(-losses[indices], kind='stable')]
    return order[:count]

