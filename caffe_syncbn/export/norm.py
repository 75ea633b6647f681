"""Rules for the normalizations (BatchNorm, BN, SyncBN, MVN) and Scale/Bias.

In TEST phase every batch norm uses its stored statistics, so each becomes one ONNX
BatchNormalization (which runtimes fold into the convolution before it):
  BatchNorm [mean_sum, var_sum, s]      mean = mean_sum/s, var = var_sum/s (0 when s == 0),
                                        scale 1, bias 0
  BN, SyncBN [slope, bias, mean, var]   as they are; a SyncBN that keeps BatchNorm's sums
                                        (statistics: BATCHNORM) divides them by its s
  NVCaffe's BatchNorm [mean, var, 1,    as they are
    scale, bias]
The layer's own ``statistics.running()`` reads its running statistics in either convention.
Only a BatchNorm with ``use_global_stats: false`` normalizes with the batch's statistics, and
SegNet's BN (a BN that names SegNet's settings) in LEARN mode, with eps 1e-9 and its scale
and shift after; in INFERENCE mode it is y = scale * x + shift, a Mul and an Add.
"""
import numpy as np

from ..backend import to_numpy
from ..syncbn_policy import is_segnet_bn, nvcaffe_form
from .graph import Unsupported, rule


def _batch_normalization(n, scale, bias, mean, var, eps):
    if len(n.in_shapes[0]) < 2:
        raise Unsupported('needs (N, C, ...) input, got shape %s' % (n.in_shapes[0],))
    values = [np.asarray(v, np.float64).reshape(-1) for v in (scale, bias, mean, var)]
    names = [n.const(v, what) for v, what in zip(values, ('scale', 'bias', 'mean', 'var'))]
    return [n.op('BatchNormalization', n.inputs[0], *names, epsilon=eps)]


@rule('BatchNorm')
def batch_norm(n):
    layer = n.layer
    if nvcaffe_form(n.param):            # its own scale and bias; TEST reads its statistics
        return bn(n)
    if not layer.use_global_stats:
        return [_batch_statistics_norm(n, layer.eps)]
    mean, var = (to_numpy(v) for v in layer.statistics.running())
    ones, zeros = np.ones(mean.size), np.zeros(mean.size)
    return _batch_normalization(n, ones, zeros, mean, var, layer.eps)


@rule('BN', 'SyncBN')
def bn(n):
    if is_segnet_bn(n.param):
        return _segnet_bn(n)
    slope, bias = (to_numpy(v) for v in n.layer.affine())
    mean, var = (to_numpy(v) for v in n.layer.statistics.running())
    return _batch_normalization(n, slope, bias, mean, var, n.layer.eps)


def _segnet_bn(n):
    if len(n.param.top) > 1:
        raise Unsupported("the batch mean and variance tops of SegNet's BN have no ONNX form")
    layer = n.layer
    x = n.inputs[0] if layer.inference else _batch_statistics_norm(n, layer.eps)
    shape = _broadcast_shape(n, (layer.channels,), 1)
    scaled = n.op('Mul', x, n.weight(layer.SCALE, shape, 'scale'))
    return [n.op('Add', scaled, n.weight(layer.SHIFT, shape, 'shift'))]


def _batch_statistics_norm(n, eps):
    """(x - mean) / sqrt(var + eps), statistics per channel over the batch (biased var)."""
    axes = [0] + list(range(2, len(n.in_shapes[0])))
    centered = n.op('Sub', n.inputs[0], n.reduce('ReduceMean', n.inputs[0], axes))
    var = n.reduce('ReduceMean', n.op('Mul', centered, centered), axes)
    return n.op('Div', centered, n.op('Sqrt', n.op('Add', var, n.const(eps, 'eps'))))


@rule('MVN')
def mvn(n):
    p = n.param.mvn_param
    ndim = len(n.in_shapes[0])
    axes = list(range(1 if p.across_channels else min(2, ndim), ndim))
    if not axes:
        raise Unsupported('nothing to normalize over in shape %s' % (n.in_shapes[0],))
    x = n.inputs[0]
    centered = n.op('Sub', x, n.reduce('ReduceMean', x, axes))
    if not p.normalize_variance:
        return [centered]
    std = n.op('Sqrt', n.reduce('ReduceMean', n.op('Mul', centered, centered), axes))
    return [n.op('Div', centered, n.op('Add', std, n.const(p.eps, 'eps')))]


def _broadcast_shape(n, operand_shape, axis):
    """``operand_shape`` followed by 1s, so that it lines up with bottom axes from ``axis``."""
    if not operand_shape:
        return ()
    ndim = len(n.in_shapes[0])
    return tuple(operand_shape) + (1,) * (ndim - axis % ndim - len(operand_shape))


def _operand(n, learned_index, axis, what):
    """The learned blob, or bottom 1, shaped to broadcast against bottom 0."""
    if len(n.inputs) > 1:
        shape = n.in_shapes[1]
        trailing = len(_broadcast_shape(n, shape, axis)) - len(shape)
        if not trailing:
            return n.inputs[1]
        axes = list(range(len(shape), len(shape) + trailing))
        return n.op('Unsqueeze', n.inputs[1], n.ints(axes, 'axes'))
    blob = n.layer.blobs[learned_index]
    return n.weight(learned_index, _broadcast_shape(n, blob.shape, axis), what)


@rule('Scale')
def scale(n):
    layer, axis = n.layer, n.param.scale_param.axis
    y = n.op('Mul', n.inputs[0], _operand(n, 0, axis, 'scale'))
    if layer.bias_index is not None:
        shape = layer.blobs[layer.bias_index].shape
        y = n.op('Add', y, n.weight(layer.bias_index, _broadcast_shape(n, shape, axis), 'bias'))
    return [y]


@rule('Bias')
def bias(n):
    return [n.op('Add', n.inputs[0], _operand(n, 0, n.param.bias_param.axis, 'bias'))]
