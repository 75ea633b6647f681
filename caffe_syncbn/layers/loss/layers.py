"""Loss layers and Accuracy.

Every loss divides its summed loss by ``LossLayer.normalizer``: the one place that turns
Caffe's normalization modes into a divisor. It takes the count over all replicas (through
``syncbn_policy.loss_normalizer``), so N replicas with averaged gradients equal one device
on the whole batch; alone it is Caffe's ``max(1, count)``.
Labels arrive as float blobs and are truncated to int, as Caffe's ``static_cast<int>`` does.
"""
import numpy as np

from ... import caffe_pb2
from ...formats.blobs import read_blob_proto
from ...layer import Layer, register
from ...syncbn_policy import loss_normalizer
from . import array, gpu
from .gpu import bad_label_message

FULL = caffe_pb2.LossParameter.FULL
VALID = caffe_pb2.LossParameter.VALID
BATCH_SIZE = caffe_pb2.LossParameter.BATCH_SIZE
NONE = caffe_pb2.LossParameter.NONE

LOG_THRESHOLD = 1e-20         # the probability losses but SoftmaxWithLoss clamp log() here


def softmax(xp, scores, axis, out=None):
    """Softmax along ``axis``, written into ``out`` (new when None) with no temporary of
    its size: a segmentation net's scores at full size are its largest blob."""
    out = xp.subtract(scores, scores.max(axis=axis, keepdims=True), out=out,
                      dtype=None if out is None else out.dtype)
    xp.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)
    return out


def split_at(layer, blob, axis):
    """(outer, classes, inner) counts around the class axis of ``blob``."""
    try:
        axis = blob.canonical_axis(axis)
    except ValueError as e:
        raise layer.error(str(e)) from None
    return blob.count_range(0, axis), blob.shape[axis], blob.count_range(axis + 1)


def class_labels(layer, label_blob, shape, num_classes, ignore_label):
    """Integer labels of ``shape`` and the mask of non-ignored ones; ignored ones read 0."""
    xp = layer.xp
    if label_blob.count != int(np.prod(shape)):
        raise layer.error('expected %d labels (scores %s around the class axis), got label '
                          'blob %s' % (int(np.prod(shape)), shape, label_blob.shape))
    raw = label_blob.data.reshape(shape)
    label = raw.astype(np.int64)
    if ignore_label is None:
        valid = xp.ones(shape, dtype=bool)
    else:
        valid = label != ignore_label
    bad = valid & ((label < 0) | (label >= num_classes))
    layer.ctx.check_later(layer, bad.any(), lambda: bad_label_message(
        num_classes, ignore_label, raw[bad][0]))
    return xp.where(valid, label, 0), valid


def ignore_label_of(message):
    return message.ignore_label if message.HasField('ignore_label') else None


class LossLayer(Layer):
    """Shared parts: the scalar top, the normalizer and the gradient scale."""

    is_loss = True
    #: the mode used when loss_param sets neither ``normalization`` nor ``normalize``
    default_normalization = VALID

    def normalization_mode(self):
        loss_param = self.param.loss_param
        if loss_param.HasField('normalization'):
            return loss_param.normalization
        if loss_param.HasField('normalize'):     # deprecated bool: true = VALID, false = BATCH_SIZE
            return VALID if loss_param.normalize else BATCH_SIZE
        return self.default_normalization

    def normalizer(self, mode, outer_count, full_count=None, valid=None):
        """The divisor of the local loss sum (Caffe's get_normalizer, made global).

        outer_count: items before the class axis (BATCH_SIZE); full_count: every output
        (FULL); valid: mask of the non-ignored outputs (VALID; None means all of them).
        """
        if mode == NONE:
            return 1.0 / self.ctx.replicas     # the replica average then yields the plain sum
        if mode == BATCH_SIZE:
            count = outer_count
        elif mode == FULL:
            count = full_count
        elif mode == VALID:
            count = full_count if valid is None else valid.sum()
        else:
            raise self.error('unknown loss normalization mode %r' % mode)
        return loss_normalizer(self.ctx.comm, count)

    def full_values(self, blob):
        """``blob``'s data, in float32 where it is half (mixed precision): a loss sums over
        the batch, which overflows float16, and its exps and logs need float32's digits."""
        data = blob.data
        return data.astype(np.promote_types(data.dtype, np.float32), copy=False)

    def set_loss(self, top, loss_sum, normalizer):
        self._normalizer = normalizer
        top[0].data[...] = loss_sum / normalizer

    def grad_scale(self, top):
        """Loss weight (written into the top's diff by the Net) over the normalizer."""
        return top[0].diff / self._normalizer

    def reshape(self, bottom, top):
        if bottom[0].shape[:1] != bottom[1].shape[:1]:
            raise self.error('bottoms must share the first axis, got %s and %s'
                             % (bottom[0].shape, bottom[1].shape))
        top[0].reshape(())

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1               # bottom 1 holds labels or targets

    def refuse_label_gradient(self, propagate_down, index=1):
        if len(propagate_down) > index and propagate_down[index]:
            raise self.error('cannot backpropagate to bottom %d (labels/targets)' % index)


class _SoftmaxLoss(LossLayer):
    """Softmax over a class axis, then a loss on the label's row: SoftmaxWithLoss, Infogain."""

    def axis_param(self):
        raise NotImplementedError

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        self.outer, self.classes, self.inner = split_at(self, bottom[0], self.axis_param())
        if self.classes == 0:
            raise self.error('the class axis of the scores, shape %s, has size 0'
                             % (bottom[0].shape,))
        if len(top) > 1:
            top[1].reshape(bottom[0].shape)

    def softmax_and_labels(self, bottom, top):
        xp = self.xp
        scores = bottom[0].data.reshape(self.outer, self.classes, self.inner)
        prob = getattr(self, 'prob', None)
        if prob is None or prob.shape != scores.shape:
            # half scores (mixed precision) take their softmax in float32, as full_values
            # says why, read straight from the half blob: no float32 copy of the scores
            prob = xp.empty(scores.shape, np.promote_types(scores.dtype, np.float32))
        self.prob = softmax(xp, scores, axis=1, out=prob)
        if len(top) > 1:
            top[1].data[...] = self.prob.reshape(bottom[0].shape)
        self.label, self.valid = class_labels(self, bottom[1], (self.outer, self.inner),
                                              self.classes, self.ignore_label)
        self.normalizer_value = self.normalizer(self.mode, self.outer,
                                                self.outer * self.inner, self.valid)


@register('SoftmaxWithLoss')
class SoftmaxWithLossLayer(_SoftmaxLoss):
    """-log softmax(score)[label], averaged by the normalization mode."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, minimum=1, maximum=2)
        self.ignore_label = ignore_label_of(self.param.loss_param)
        self.mode = self.normalization_mode()
        # the engine, chosen once: the CUDA kernels, or array code
        self.engine = gpu if self.cuda_kernels else array

    def axis_param(self):
        return self.param.softmax_param.axis

    def forward(self, bottom, top):
        self.engine.forward(self, bottom, top)

    def backward_reads(self, bottom, top):
        return list(bottom[1:]) + list(top)    # the labels, the loss weight; prob is kept

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        self.engine.backward(self, top, propagate_down, bottom)


@register('InfogainLoss')
class InfogainLossLayer(_SoftmaxLoss):
    """-sum_l H[label, l] log softmax(score)_l, with H from a file or a third bottom."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=2, maximum=3)
        self.check_tops(top, minimum=1, maximum=2)
        self.ignore_label = ignore_label_of(self.param.loss_param)
        self.mode = self.normalization_mode()
        self.file_matrix = None
        if len(bottom) < 3:
            self.file_matrix = self.xp.asarray(self._read_matrix(), dtype=self.dtype)

    def _read_matrix(self):
        source = self.param.infogain_loss_param.source
        if not source:
            raise self.error('needs infogain_loss_param.source or a third bottom (H)')
        return read_blob_proto(source).ravel()

    def axis_param(self):
        return self.param.infogain_loss_param.axis

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        size = bottom[2].count if len(bottom) > 2 else self.file_matrix.size
        if size != self.classes ** 2:
            raise self.error('H must hold %d x %d values (one row per class), got %d'
                             % (self.classes, self.classes, size))

    def forward(self, bottom, top):
        xp = self.xp
        matrix = bottom[2].data if len(bottom) > 2 else self.file_matrix
        self.H = matrix.reshape(self.classes, self.classes)
        self.softmax_and_labels(bottom, top)
        # H rows of each item's label, laid out like the scores: (outer, classes, inner)
        self.H_rows = self.H[self.label].transpose(0, 2, 1) * self.valid[:, None, :]
        log_p = xp.log(xp.maximum(self.prob, LOG_THRESHOLD))
        self.set_loss(top, -xp.sum(self.H_rows * log_p), self.normalizer_value)

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        self.refuse_label_gradient(propagate_down, 2)
        if not propagate_down[0]:
            return
        row_sums = self.H_rows.sum(axis=1, keepdims=True)
        grad = self.prob * row_sums - self.H_rows
        bottom[0].diff[...] = (grad * self.grad_scale(top)).reshape(bottom[0].shape)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0               # neither labels nor H get a gradient


@register('SigmoidCrossEntropyLoss')
class SigmoidCrossEntropyLossLayer(LossLayer):
    """Cross-entropy of sigmoid(score) against targets in [0, 1]."""

    default_normalization = BATCH_SIZE

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, exact=1)
        self.ignore_label = ignore_label_of(self.param.loss_param)
        self.mode = self.normalization_mode()

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if bottom[0].count != bottom[1].count:
            raise self.error('scores and targets must have the same count, got %s and %s'
                             % (bottom[0].shape, bottom[1].shape))

    def forward(self, bottom, top):
        xp = self.xp
        x = self.full_values(bottom[0])
        target = bottom[1].data.reshape(x.shape)
        self.valid = None
        if self.ignore_label is not None:
            self.valid = target.astype(np.int64) != self.ignore_label
        # log(1 + exp(-|x|)) form: stable for large |x|
        loss = -(x * (target - (x >= 0)) - xp.log1p(xp.exp(-xp.abs(x))))
        if self.valid is not None:
            loss = loss * self.valid
        n = self.normalizer(self.mode, x.shape[0], x.size, self.valid)
        self.set_loss(top, xp.sum(loss), n)

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        x = self.full_values(bottom[0])
        grad = 1 / (1 + self.xp.exp(-x)) - bottom[1].data.reshape(x.shape)
        if self.valid is not None:
            grad = grad * self.valid
        bottom[0].diff[...] = grad * self.grad_scale(top)


@register('EuclideanLoss')
class EuclideanLossLayer(LossLayer):
    """sum((a - b)^2) / 2N; both bottoms get gradients."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, exact=1)

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        if bottom[0].count != bottom[1].count:
            raise self.error('both bottoms must have the same count, got %s and %s'
                             % (bottom[0].shape, bottom[1].shape))

    def forward(self, bottom, top):
        self.difference = self.full_values(bottom[0]) - \
            self.full_values(bottom[1]).reshape(bottom[0].shape)
        n = 2 * self.normalizer(BATCH_SIZE, bottom[0].shape[0])
        self.set_loss(top, self.xp.sum(self.difference ** 2), n)

    def backward(self, top, propagate_down, bottom):
        grad = self.difference * (2 * self.grad_scale(top))
        for i, sign in ((0, 1), (1, -1)):
            if propagate_down[i]:
                bottom[i].diff[...] = (sign * grad).reshape(bottom[i].shape)

    def allow_force_backward(self, bottom_index):
        return True


@register('HingeLoss')
class HingeLossLayer(LossLayer):
    """One-vs-all hinge: max(0, 1 - y*score) with y = +1 for the label, -1 otherwise."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, exact=1)
        self.squared = self.param.hinge_loss_param.norm == caffe_pb2.HingeLossParameter.L2

    def forward(self, bottom, top):
        xp = self.xp
        num = bottom[0].shape[0]
        scores = self.full_values(bottom[0]).reshape(num, bottom[0].count_range(1))
        label, _ = class_labels(self, bottom[1], (num,), scores.shape[1], None)
        self.sign = 1 - 2 * (xp.arange(scores.shape[1])[None, :] == label[:, None])
        self.margin = xp.maximum(0, 1 + self.sign * scores)
        loss = xp.sum(self.margin ** 2) if self.squared else xp.sum(self.margin)
        self.set_loss(top, loss, self.normalizer(BATCH_SIZE, num))

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        # d margin / d score is sign where the margin is positive, 0 elsewhere
        if self.squared:
            grad = 2 * self.margin * self.sign
        else:
            grad = (self.margin > 0) * self.sign
        bottom[0].diff[...] = (grad * self.grad_scale(top)).reshape(bottom[0].shape)


@register('ContrastiveLoss')
class ContrastiveLossLayer(LossLayer):
    """Pairs (a, b) with similarity s: d^2 if similar, else max(margin - d, 0)^2 (legacy:
    max(margin - d^2, 0)); summed and divided by 2N."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=3)
        self.check_tops(top, exact=1)
        self.margin = self.param.contrastive_loss_param.margin
        self.legacy = self.param.contrastive_loss_param.legacy_version

    def reshape(self, bottom, top):
        super().reshape(bottom, top)
        num = bottom[0].shape[0]
        if bottom[0].shape != bottom[1].shape or bottom[2].count != num:
            raise self.error('expected a and b of one shape and one similarity per pair, got '
                             '%s, %s and %s' % (bottom[0].shape, bottom[1].shape, bottom[2].shape))

    def forward(self, bottom, top):
        xp = self.xp
        num = bottom[0].shape[0]
        difference = self.full_values(bottom[0]) - self.full_values(bottom[1])
        self.difference = difference.reshape(num, bottom[0].count_range(1))
        self.dist_sq = xp.sum(self.difference ** 2, axis=1)
        self.similar = bottom[2].data.reshape(num).astype(np.int64) != 0
        if self.legacy:
            dissimilar = xp.maximum(self.margin - self.dist_sq, 0)
        else:
            dissimilar = xp.maximum(self.margin - xp.sqrt(self.dist_sq), 0) ** 2
        loss = xp.sum(xp.where(self.similar, self.dist_sq, dissimilar))
        self.set_loss(top, loss, 2 * self.normalizer(BATCH_SIZE, num))

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down, 2)
        xp = self.xp
        if self.legacy:
            coeff = -((self.margin - self.dist_sq) > 0).astype(self.dtype)
        else:
            dist = xp.sqrt(self.dist_sq)
            # Caffe's gradient adds 1e-4 to d in the denominator to stay finite at d = 0
            coeff = -xp.maximum(self.margin - dist, 0) / (dist + 1e-4)
        coeff = xp.where(self.similar, 1, coeff)
        grad = coeff[:, None] * self.difference * (2 * self.grad_scale(top))
        for i, sign in ((0, 1), (1, -1)):
            if propagate_down[i]:
                bottom[i].diff[...] = (sign * grad).reshape(bottom[i].shape)

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2


@register('MultinomialLogisticLoss')
class MultinomialLogisticLossLayer(LossLayer):
    """-log(prob[label]) over probabilities (clamped at 1e-20), divided by N."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, exact=1)

    def forward(self, bottom, top):
        xp = self.xp
        num = bottom[0].shape[0]
        prob = self.full_values(bottom[0]).reshape(num, bottom[0].count_range(1))
        self.label, _ = class_labels(self, bottom[1], (num,), prob.shape[1], None)
        self.p_true = xp.maximum(xp.take_along_axis(prob, self.label[:, None], axis=1),
                                 LOG_THRESHOLD)
        self.set_loss(top, -xp.sum(xp.log(self.p_true)), self.normalizer(BATCH_SIZE, num))

    def backward(self, top, propagate_down, bottom):
        self.refuse_label_gradient(propagate_down)
        if not propagate_down[0]:
            return
        xp = self.xp
        num = bottom[0].shape[0]
        classes = bottom[0].count // max(num, 1)
        onehot = xp.arange(classes)[None, :] == self.label[:, None]
        grad = onehot * (-1 / self.p_true)
        bottom[0].diff[...] = (grad * self.grad_scale(top)).reshape(bottom[0].shape)
