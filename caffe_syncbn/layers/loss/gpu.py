"""SoftmaxWithLoss's CUDA engine (cuda/loss.cu), with the array engine's signatures
(array.py): one kernel for the softmax, the per-position loss and the valid mask, one for
the gradient. The layer's normalizer (global over replicas) and loss top are used as on the
CPU."""
import numpy as np

from ...backend import cuda_kernels
from ...backend.launch import BLOCK, contiguous, grid_1d, i32, i64


def bad_label_message(num_classes, ignore_label, label):
    """The error of a label out of range (``label`` read from the device only then)."""
    return 'labels must lie in [0, %d) or equal ignore_label (%s), got %g' % (
        num_classes, ignore_label, float(label))


def _label_args(layer):
    ignore = layer.ignore_label
    return (i32(ignore is not None), i32(ignore if ignore is not None else 0))


def _labels(layer, bottom):
    if bottom[1].count != layer.outer * layer.inner:
        raise layer.error('expected %d labels (scores %s around the class axis), got label '
                          'blob %s' % (layer.outer * layer.inner, bottom[0].shape, bottom[1].shape))
    return contiguous(layer.xp, bottom[1].data.astype(bottom[0].data.dtype, copy=False))


def forward(layer, bottom, top):
    xp = layer.xp
    scores = contiguous(xp, bottom[0].data)
    labels = _labels(layer, bottom)
    acc = np.float64 if scores.dtype == np.float64 else np.float32
    positions = layer.outer * layer.inner
    prob = xp.empty((layer.outer, layer.classes, layer.inner), scores.dtype)
    loss, valid = xp.empty(positions, acc), xp.empty(positions, acc)
    if positions:
        cuda_kernels.typed_kernel('loss', 'softmax_loss_forward', scores.dtype)(
            grid_1d(positions), (BLOCK,),
            (scores, labels, i32(layer.outer), i32(layer.classes), i64(layer.inner))
            + _label_args(layer) + (prob, loss, valid))
    layer.prob, layer._gpu_labels = prob, labels
    if len(top) > 1:
        top[1].data[...] = prob.reshape(bottom[0].shape)
    if positions:
        layer.ctx.check_later(layer, (valid < 0).any(), lambda: bad_label_message(
            layer.classes, layer.ignore_label, labels.reshape(-1)[valid < 0][0]))
    layer.normalizer_value = layer.normalizer(layer.mode, layer.outer, positions, valid > 0)
    layer.set_loss(top, loss.sum(), layer.normalizer_value)


def backward(layer, top, propagate_down, bottom):
    if not propagate_down[0]:
        return
    xp = layer.xp
    prob = layer.prob
    dx = xp.empty(prob.shape, prob.dtype)
    if dx.size:
        cuda_kernels.typed_kernel('loss', 'softmax_loss_backward', prob.dtype)(
            grid_1d(dx.size), (BLOCK,),
            (prob, layer._gpu_labels, i32(layer.outer), i32(layer.classes), i64(layer.inner))
            + _label_args(layer) + (xp.asarray(top[0].diff.reshape(1), np.float64),
                                    xp.asarray(layer.normalizer_value, np.float64).reshape(1),
                                    dx))
    bottom[0].diff[...] = dx.reshape(bottom[0].shape)
