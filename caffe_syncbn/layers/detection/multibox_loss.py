"""MultiBoxLoss, the SSD fork's training loss: bottoms (loc, conf, priors, ground truth).

Per image, each prior box is matched to a ground-truth box (multibox_match.py); matched
priors are positives, whose encoded offsets get a localization loss (smooth L1 or L2)
and whose scores get a confidence loss (softmax or logistic) towards the box's label;
mined negatives (or, without mining, every other prior) get a confidence loss towards
the background. Both sums are divided by one normalizer.

Rules kept from the fork (docs/detection.md lists them):
* the loss adds the localization term only when the layer's ``propagate_down`` (the
  prototxt's; unset means true, true, false, false) lets bottom 0 learn, and the
  confidence term only when it lets bottom 1 learn;
* ground-truth rows whose item id is -1 are padding and skipped; a row with the
  background label is an error;
* negatives are ranked by the loss of their background class on the raw scores
  (MAX_NEGATIVE), or every prior by its confidence plus localization loss towards
  its own target (HARD_EXAMPLE, which drops the positives it does not pick);
* logistic targets start as the background label's number (0 unless it is changed);
* with ``encode_variance_in_target`` the fork also divides predictions and targets by
  the variances; its gradient then leaves out that factor, this layer's does not.

RefineDet's two-step form (its ODM loss) adds the anchor refinement module's outputs:
bottom 4 its objectness (N, priors * 2), softmax probabilities (background, object): only
the priors whose objectness reaches ``objectness_score`` are mined as negatives; bottom 5
its offsets (N, priors * 4): the priors moved by them are the ones matched (with
``use_prior_for_matching``) and the ones the targets are encoded against. As in the fork,
HARD_EXAMPLE ranks the localization loss against the unmoved priors. Its ARM loss, of
two classes, reads every ground-truth label from 2 up as class 1 (object), so that it
trains on the dataset's labels; the SSD fork has no such rule and fails on those labels.

Data parallelism: matching and mining stay within each image, and the normalizer is
the count over all replicas (syncbn_policy.loss_normalizer), so N replicas of b images
with averaged gradients equal one device on N * b images.
"""
import numpy as np

from ... import caffe_pb2
from ...backend import to_numpy
from ...layer import Layer, register
from ...syncbn_policy import loss_normalizer
from . import boxes as host_boxes, gpu as detection_gpu
from .boxes import CENTER_SIZE, CORNER, CORNER_SIZE, decode_boxes
from .multibox_match import (UNMATCHED, crosses_boundary, encode_boxes, loc_gradients,
                             loc_losses, logistic_losses, match_boxes, select_examples,
                             softmax_losses)

MBL = caffe_pb2.MultiBoxLossParameter
LOSS = caffe_pb2.LossParameter
#: the fork's default for a layer whose prototxt sets no propagate_down
DEFAULT_PROPAGATE = (True, True, False, False)
GT_WIDTH = 8     # item_id, label, instance_id, xmin, ymin, xmax, ymax, difficult


@register('MultiBoxLoss')
class MultiBoxLossLayer(Layer):
    is_loss = True

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=4, maximum=6)
        self.check_tops(top, exact=1)
        p = self.param.multibox_loss_param
        if not p.HasField('num_classes') or p.num_classes < 1:
            raise self.error('multibox_loss_param.num_classes must be set to 1 or more')
        self.p = p
        self.num_classes = p.num_classes
        self.loc_classes = 1 if p.share_location else self.num_classes
        self.background = p.background_label_id
        self.mining = p.mining_type
        if p.HasField('do_neg_mining') and p.do_neg_mining != (self.mining != MBL.NONE):
            raise self.error('do_neg_mining %s contradicts mining_type %s'
                             % (p.do_neg_mining, MBL.MiningType.Name(self.mining)))
        if self.mining != MBL.NONE and not p.share_location:
            raise self.error('negative mining needs share_location: true')
        if self.mining == MBL.HARD_EXAMPLE and p.sample_size <= 0:
            raise self.error('HARD_EXAMPLE mining needs sample_size > 0, got %d'
                             % p.sample_size)
        if self.mining != MBL.NONE and p.HasField('nms_param') and p.nms_param.nms_threshold > 0:
            raise self.error('non-maximum suppression of the mined examples (nms_param) '
                             'is not implemented')
        if p.conf_loss_type == MBL.SOFTMAX and self.background >= self.num_classes:
            raise self.error('background_label_id %d must lie in [0, %d) for the softmax loss'
                             % (self.background, self.num_classes))
        if p.map_object_to_agnostic and self.num_classes != 2:
            raise self.error('map_object_to_agnostic needs num_classes 2, got %d'
                             % self.num_classes)
        if p.code_type not in (CORNER, CENTER_SIZE, CORNER_SIZE):
            raise self.error('unknown code_type %d' % p.code_type)
        if len(bottom) == 6 and not p.share_location:
            raise self.error("RefineDet's ARM offsets (bottom 5) need share_location: true")
        loss_param = self.param.loss_param
        if not loss_param.HasField('normalization') and loss_param.HasField('normalize'):
            self.normalization = LOSS.VALID if loss_param.normalize else LOSS.BATCH_SIZE
        else:
            self.normalization = loss_param.normalization
        flags = list(self.param.propagate_down) or list(DEFAULT_PROPAGATE)
        self.adds_loc, self.adds_conf = bool(flags[0]), bool(flags[1])
        # the engine of the decoding and overlaps over every prior, chosen once
        self.engine = detection_gpu if self.cuda_kernels else host_boxes

    def reshape(self, bottom, top):
        self.num = bottom[0].shape[0]
        prior_shape = bottom[2].shape
        if len(prior_shape) != 3 or prior_shape[:2] != (1, 2) or prior_shape[2] % 4:
            raise self.error('priors (bottom 2) must be a PriorBox top (1, 2, 4 * priors), '
                             'got %s' % (prior_shape,))
        self.num_priors = prior_shape[2] // 4
        if bottom[1].shape[0] != self.num:
            raise self.error('loc and conf must hold the same images, got %s and %s'
                             % (bottom[0].shape, bottom[1].shape))
        for blob, per_prior, what in ((bottom[0], self.loc_classes * 4, 'loc'),
                                      (bottom[1], self.num_classes, 'conf')):
            if blob.count != self.num * self.num_priors * per_prior:
                raise self.error('%s (bottom %s) must hold %d values per image (%d priors x %d)'
                                 ', got shape %s' % (what, 0 if what == 'loc' else 1,
                                                     self.num_priors * per_prior,
                                                     self.num_priors, per_prior, blob.shape))
        for index, per_prior, what in ((4, 2, 'ARM objectness'), (5, 4, 'ARM offsets')):
            if len(bottom) > index and \
                    bottom[index].count != self.num * self.num_priors * per_prior:
                raise self.error('%s (bottom %d) must hold %d values per image (%d priors x %d)'
                                 ', got shape %s' % (what, index, self.num_priors * per_prior,
                                                     self.num_priors, per_prior,
                                                     bottom[index].shape))
        if bottom[3].count % GT_WIDTH:
            raise self.error('ground truth (bottom 3) must hold rows of %d values, got shape %s'
                             % (GT_WIDTH, bottom[3].shape))
        top[0].reshape(())

    def allow_force_backward(self, bottom_index):
        return bottom_index < 2

    # --- forward -------------------------------------------------------------------

    def ground_truth(self, rows):
        """Per image: (boxes (G, 4), labels (G,)) of its usable ground truth, in order."""
        boxes = [[] for _ in range(self.num)]
        labels = [[] for _ in range(self.num)]
        for row in rows.reshape(-1, GT_WIDTH):
            item = int(row[0])
            if item == -1:
                continue
            label = int(row[1])
            if self.num_classes == 2 and label >= 2:
                label = 1             # RefineDet's ARM: every object is the object class
            if not 0 <= item < self.num:
                raise self.error('ground truth item_id %d outside the batch of %d images'
                                 % (item, self.num))
            if label == self.background:
                raise self.error('ground truth of image %d has the background label %d'
                                 % (item, label))
            if not self.p.map_object_to_agnostic and not 0 <= label < self.num_classes:
                raise self.error('ground truth label %d outside [0, %d)'
                                 % (label, self.num_classes))
            if bool(row[7]) and not self.p.use_difficult_gt:
                continue
            boxes[item].append(row[3:7])
            labels[item].append(label)
        return [(np.array(b, rows.dtype).reshape(-1, 4), np.array(l, np.int64))
                for b, l in zip(boxes, labels)]

    def match_image(self, image, gt_boxes, gt_labels):
        """{label: (match, best overlap)} of one image; empty when it has no ground truth."""
        p = self.p
        if len(gt_boxes) == 0:
            return {}
        if p.use_prior_for_matching:
            match, overlap = self.match(self.prior_boxes[image], gt_boxes)
            if p.share_location:
                return {-1: (match, overlap)}
            return {c: (np.where((match >= 0) & (gt_labels[np.maximum(match, 0)] == c),
                                 match, UNMATCHED), overlap)
                    for c in range(self.num_classes) if c != self.background}
        if p.share_location:
            return {-1: self.match(self.decoded[image, :, 0], gt_boxes)}
        matches = {}
        for c in range(self.num_classes):
            if c == self.background:
                continue
            of_class = np.flatnonzero(gt_labels == c)
            match, overlap = self.match(self.decoded[image, :, c], gt_boxes[of_class])
            match[match >= 0] = of_class[match[match >= 0]]
            matches[c] = (match, overlap)
        return matches

    def match(self, boxes, gt_boxes):
        """match_boxes of ``boxes`` (P, 4), arrays of the engine, against host ``gt_boxes``."""
        p = self.p
        ignored = crosses_boundary(to_numpy(boxes)) if p.ignore_cross_boundary_bbox else None
        return match_boxes(to_numpy(self.engine.overlap_matrix(boxes, gt_boxes)), ignored,
                           p.match_type == MBL.PER_PREDICTION, p.overlap_threshold)

    def loc_terms(self, loc, priors, priors_index, gt):
        """(prediction rows, target rows, gradient factor) of matched priors' offsets,
        ``priors`` the boxes of the priors ``priors_index`` (their variances are the
        PriorBox's)."""
        p = self.p
        variances = self.variances[priors_index]
        if p.code_type == CENTER_SIZE and (np.any(gt[:, 2] <= gt[:, 0])
                                           or np.any(gt[:, 3] <= gt[:, 1])):
            raise self.error('a matched ground-truth box has no width or height: %s'
                             % gt[(gt[:, 2] <= gt[:, 0]) | (gt[:, 3] <= gt[:, 1])][0])
        target = encode_boxes(priors, variances, gt, p.code_type, p.encode_variance_in_target)
        prediction = loc
        if p.bp_inside:
            # a side of the matched box outside the image gets no gradient: its prediction
            # is replaced by the target
            box = priors if p.use_prior_for_matching else decode_boxes(
                priors, variances, loc, p.code_type, p.encode_variance_in_target)
            prediction = np.where((box < 0) | (box > 1), target, loc)
        factor = np.ones_like(target)
        if p.encode_variance_in_target:
            prediction, target, factor = prediction / variances, target / variances, 1 / variances
        return prediction, target, factor

    def positives(self, matches):
        """(image, loc class, prior, label key, gt index) rows of every matched prior."""
        rows = []
        for image, by_label in enumerate(matches):
            for label in sorted(by_label):
                match = by_label[label][0]
                for prior in np.flatnonzero(match >= 0):
                    rows.append((image, max(label, 0), prior, label, match[prior]))
        return np.array(rows, np.int64).reshape(-1, 5)

    def mine(self, conf, loc, gts, matches):
        """Negative prior indices of each image; HARD_EXAMPLE also unmatches positives."""
        p = self.p
        negatives = []
        for image, by_label in enumerate(matches):
            labels = np.full(self.num_priors, self.background, np.int64)
            for label in sorted(by_label, reverse=True):     # the first matching label wins
                match = by_label[label][0]
                labels[match >= 0] = gts[image][1][match[match >= 0]]
            loss = self.conf_rank_losses(conf[image], labels)
            if self.mining == MBL.HARD_EXAMPLE:
                for label, (match, _) in by_label.items():
                    matched = np.flatnonzero(match >= 0)
                    if len(matched):
                        prediction, target, _ = self.loc_terms(
                            loc[image, matched, max(label, 0)], self.priors[matched], matched,
                            gts[image][0][match[matched]])
                        loss[matched] += loc_losses(prediction - target,
                                                    p.loc_loss_type == MBL.SMOOTH_L1)
            loss = loss.astype(np.float32)            # the fork ranks float losses
            chosen = []
            for label in sorted(by_label):
                match, overlap = by_label[label]
                if self.mining == MBL.MAX_NEGATIVE:
                    eligible = (match == UNMATCHED) & (overlap < p.neg_overlap)
                    wanted = int(np.float32(np.sum(match >= 0)) * np.float32(p.neg_pos_ratio))
                else:
                    eligible = np.ones(self.num_priors, bool)
                    wanted = p.sample_size
                if self.objectness is not None:
                    eligible &= self.objectness[image] >= np.float32(p.objectness_score)
                selected = np.zeros(self.num_priors, bool)
                selected[select_examples(loss, eligible, min(wanted, int(eligible.sum())))] = True
                if self.mining == MBL.HARD_EXAMPLE:
                    match[(match >= 0) & ~selected] = UNMATCHED
                chosen.extend(np.flatnonzero((match == UNMATCHED) & selected))
            negatives.append(np.array(chosen, np.int64))
        return negatives

    def conf_rank_losses(self, scores, labels):
        if self.p.conf_loss_type == MBL.SOFTMAX:
            return softmax_losses(scores, labels)[0]
        targets = np.zeros_like(scores)
        in_range = (labels >= 0) & (labels < self.num_classes)
        targets[np.flatnonzero(in_range), labels[in_range]] = 1
        return logistic_losses(scores, targets)

    def forward(self, bottom, top):
        p = self.p
        loc = to_numpy(bottom[0].data).reshape(self.num, self.num_priors, self.loc_classes, 4)
        conf = to_numpy(bottom[1].data).reshape(self.num, self.num_priors, self.num_classes)
        prior_data = bottom[2].data.reshape(2, self.num_priors, 4)
        self.priors, self.variances = to_numpy(prior_data)
        self.objectness = (to_numpy(bottom[4].data).reshape(self.num, self.num_priors, 2)[..., 1]
                           if len(bottom) > 4 else None)
        if len(bottom) > 5:
            # RefineDet: every image's priors moved by its ARM offsets, on the engine
            moved = self.engine.decode_all(
                bottom[5].data.reshape(self.num, self.num_priors, 1, 4), prior_data,
                p.code_type, p.encode_variance_in_target)
            self.prior_boxes = moved[:, :, 0]
            self.image_priors = to_numpy(self.prior_boxes).astype(self.priors.dtype)
        else:
            self.prior_boxes = [prior_data[0]] * self.num
            self.image_priors = [self.priors] * self.num
        if not p.use_prior_for_matching:
            self.decoded = self.engine.decode_all(
                bottom[0].data.reshape(loc.shape), prior_data, p.code_type,
                p.encode_variance_in_target)
        gts = self.ground_truth(to_numpy(bottom[3].data))
        matches = [self.match_image(image, boxes, labels)
                   for image, (boxes, labels) in enumerate(gts)]
        negatives = (self.mine(conf, loc, gts, matches) if self.mining != MBL.NONE
                     else None)
        positives = self.positives(matches)
        num_matches = len(positives)
        loc_sum = self.loc_forward(loc, gts, positives)
        conf_sum = self.conf_forward(conf, gts, positives, negatives)
        count = {LOSS.FULL: self.num * self.num_priors, LOSS.VALID: num_matches,
                 LOSS.BATCH_SIZE: self.num}
        if self.normalization == LOSS.NONE:
            self.normalizer_value = 1.0 / self.ctx.replicas
        elif self.normalization in count:
            self.normalizer_value = loss_normalizer(self.ctx.comm, count[self.normalization])
        else:
            raise self.error('unknown loss normalization mode %r' % self.normalization)
        loss = 0.0
        if self.adds_loc:
            loss += p.loc_weight * loc_sum / self.normalizer_value
        if self.adds_conf:
            loss += conf_sum / self.normalizer_value
        top[0].data[...] = loss

    def loc_forward(self, loc, gts, positives):
        image, loc_class, prior, _, gt_index = positives.T
        self.loc_slots = (image, prior, loc_class)
        if len(positives) == 0:
            self.loc_grad = np.zeros((0, 4), loc.dtype)
            return 0.0
        gt = np.stack([gts[i][0][g] for i, g in zip(image, gt_index)])
        priors = np.stack([self.image_priors[i][j] for i, j in zip(image, prior)])
        prediction, target, factor = self.loc_terms(loc[image, prior, loc_class], priors,
                                                    prior, gt)
        smooth_l1 = self.p.loc_loss_type == MBL.SMOOTH_L1
        self.loc_grad = loc_gradients(prediction - target, smooth_l1) * factor
        return float(loc_losses(prediction - target, smooth_l1).sum())

    def positive_label(self, gts, image, gt_index):
        if self.p.map_object_to_agnostic:
            return self.background + 1
        return int(gts[image][1][gt_index])

    def conf_forward(self, conf, gts, positives, negatives):
        """The confidence loss sum; keeps its gradient rows and their (image, prior)."""
        p = self.p
        if negatives is None:        # every prior: background unless matched
            images = np.repeat(np.arange(self.num), self.num_priors)
            priors = np.tile(np.arange(self.num_priors), self.num)
            labels = np.full(self.num * self.num_priors, self.background, np.int64)
            for image, _, prior, _, gt_index in positives:
                labels[image * self.num_priors + prior] = self.positive_label(gts, image, gt_index)
            is_negative = np.zeros(len(labels), bool)
        else:
            images, priors, labels, is_negative = [], [], [], []
            for image in range(self.num):
                mine = positives[positives[:, 0] == image]
                images += [image] * (len(mine) + len(negatives[image]))
                priors += list(mine[:, 2]) + list(negatives[image])
                labels += [self.positive_label(gts, image, g) for g in mine[:, 4]]
                labels += [self.background] * len(negatives[image])
                is_negative += [False] * len(mine) + [True] * len(negatives[image])
            images, priors = np.array(images, np.int64), np.array(priors, np.int64)
            labels, is_negative = np.array(labels, np.int64), np.array(is_negative, bool)
        self.conf_slots = (images, priors)
        scores = conf[images, priors]
        if len(scores) == 0:
            self.conf_grad = scores
            return 0.0
        if p.conf_loss_type == MBL.SOFTMAX:
            losses, prob = softmax_losses(scores, labels)
            self.conf_grad = prob
            self.conf_grad[np.arange(len(labels)), labels] -= 1
            return float(losses.sum())
        # the fork fills logistic targets with the background label's number first
        targets = np.full(scores.shape, float(self.background), scores.dtype)
        rows = np.arange(len(labels))
        targets[rows[~is_negative & (labels != self.background)],
                labels[~is_negative & (labels != self.background)]] = 1
        if 0 <= self.background < self.num_classes:
            targets[rows[is_negative], self.background] = 1
        self.conf_grad = 1 / (1 + np.exp(-scores)) - targets
        return float(logistic_losses(scores, targets).sum())

    # --- backward ------------------------------------------------------------------

    def backward(self, top, propagate_down, bottom):
        for index, what in ((2, 'priors'), (3, 'ground truth'), (4, 'ARM objectness'),
                            (5, 'ARM offsets')):
            if len(propagate_down) > index and propagate_down[index]:
                raise self.error('cannot backpropagate to bottom %d (%s); give the layer '
                                 'propagate_down: true true%s' % (index, what,
                                                                  ' false' * (len(bottom) - 2)))
        scale = float(to_numpy(top[0].diff)) / self.normalizer_value
        if propagate_down[0]:
            diff = np.zeros((self.num, self.num_priors, self.loc_classes, 4), self.loc_grad.dtype)
            diff[self.loc_slots] = self.loc_grad * (self.p.loc_weight * scale)
            bottom[0].diff[...] = self.xp.asarray(diff.reshape(bottom[0].shape))
        if propagate_down[1]:
            diff = np.zeros((self.num, self.num_priors, self.num_classes), self.conf_grad.dtype)
            diff[self.conf_slots] = self.conf_grad * scale
            bottom[1].diff[...] = self.xp.asarray(diff.reshape(bottom[1].shape))
