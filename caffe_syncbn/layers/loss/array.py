"""SoftmaxWithLoss's array engine, which runs on numpy and CuPy alike, with the signatures of
the CUDA engine (gpu.py): the layer's softmax and labels (SoftmaxWithLossLayer in
layers.py), then the loss, clamped at FLT_MIN as in Caffe, and its gradient."""
import numpy as np

FLT_MIN = float(np.finfo(np.float32).tiny)


def forward(layer, bottom, top):
    xp = layer.xp
    layer.softmax_and_labels(bottom, top)
    p_true = xp.take_along_axis(layer.prob, layer.label[:, None, :], axis=1)[:, 0, :]
    log_p = xp.log(xp.maximum(p_true, FLT_MIN))
    layer.set_loss(top, -xp.sum(xp.where(layer.valid, log_p, 0)), layer.normalizer_value)


def backward(layer, top, propagate_down, bottom):
    """The scores' gradient, prob - onehot, written in place into bottom 0's diff."""
    if not propagate_down[0]:
        return
    xp = layer.xp
    diff = bottom[0].diff.reshape(layer.outer, layer.classes, layer.inner)
    # half diffs (mixed precision) take the gradient from float32's prob, rounded once
    grad = diff if diff.dtype == layer.prob.dtype else layer.prob.copy()
    grad[...] = layer.prob
    grad[xp.arange(layer.outer)[:, None], layer.label, xp.arange(layer.inner)[None, :]] -= 1
    grad *= layer.valid[:, None, :]
    grad *= layer.grad_scale(top)
    if grad is not diff:
        diff[...] = grad
