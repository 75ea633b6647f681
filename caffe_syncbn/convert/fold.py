"""Folding TEST-mode batch norms into the layer before them, for deployment.

In TEST a norm unit (BatchNorm(+Scale), NVCaffe's BatchNorm, BN or SyncBN, see
weights/norm_forms.py) is a per-channel affine y = a * x + c, with a = slope / sqrt(var +
eps) and c = bias - mean * a (SegNet's BN in INFERENCE mode holds a and c as they are; in
LEARN mode it is no affine). When x comes straight from a Convolution, Deconvolution or
InnerProduct whose output nothing else reads, the affine folds into that layer's weights
(W * a per output channel, b * a + c, a bias added where there was none) and the unit
disappears. Otherwise (after a ReLU, an Eltwise,
an Input, or on a blob that other layers also read) it becomes one Scale layer with bias,
named as the unit, which is one pass instead of two.

Before anything is folded, the weights are copied into the net the prototxt makes, so
that weights for another net, or for other inputs, are refused, not folded.
"""
import collections
import logging

import numpy as np

from .. import caffe_pb2
from ..errors import CaffeError
from ..formats.caffemodel import read_weights
from ..layer import TEST, LayerContext
from ..net import Net
from ..netparam.graph import filter_net, net_state
from ..netparam.upgrade import load_net_param
from ..syncbn_policy import is_segnet_bn, norm_eps, nvcaffe_form
from ..weights.copy import arrays_of, with_shared_params
from ..weights.norm_forms import norm_units, stored_layout, stored_stats
from .inputs import copy_checked, with_inputs

log = logging.getLogger('caffe_syncbn')

_FOLDS_INTO = ('Convolution', 'Deconvolution', 'InnerProduct')


def _affine(layer, arrays, scale_arrays, layout):
    """(a, c, dtype) of a unit's stored arrays in ``layout`` (norm_forms.stored_layout).
    SegNet's BN in INFERENCE mode is the affine itself: [scale, shift]."""
    if is_segnet_bn(layer):
        scale, shift = (np.asarray(v) for v in arrays)
        return scale.astype(np.float64).reshape(-1), shift.astype(np.float64).reshape(-1), \
            scale.dtype
    stats = stored_stats(arrays, scale_arrays, layout)
    a = stats.slope / np.sqrt(stats.var + norm_eps(layer))
    return a, stats.bias - stats.mean * a, stats.dtype


def _uses_batch_statistics(layer):
    """A BatchNorm that says use_global_stats: false, or SegNet's BN in LEARN mode,
    normalizes with each batch even in TEST: it is no affine and cannot fold (NVCaffe's
    BatchNorm reads no use_global_stats)."""
    if is_segnet_bn(layer):
        return layer.bn_param.bn_mode == caffe_pb2.BNParameter.LEARN
    p = layer.batch_norm_param
    return layer.type == 'BatchNorm' and p.HasField('use_global_stats') and \
        not p.use_global_stats and not nvcaffe_form(layer)


def _producer(layers, index, blob):
    """The index of the last layer before ``index`` that writes ``blob``, or None."""
    for i in range(index - 1, -1, -1):
        if blob in layers[i].top:
            return i
    return None


def _readers(layers, producer, blob):
    """Indices of the layers that read the value ``producer`` wrote to ``blob``."""
    found = []
    for i in range(producer + 1, len(layers)):
        if blob in layers[i].bottom:
            found.append(i)
        if blob in layers[i].top:
            break
    return found


def _foldable(layers, weights, unit):
    """The index of the layer ``unit`` folds into, or None."""
    bn = layers[unit.index]
    i = _producer(layers, unit.index, bn.bottom[0])
    if i is None:
        return None
    target = layers[i]
    if target.type not in _FOLDS_INTO or len(target.top) != 1 or not weights.get(target.name):
        return None
    if any(spec.name for spec in target.param):
        return None                      # shared weights would change for the sharers too
    if target.type == 'InnerProduct' and target.inner_product_param.axis != 1:
        return None                      # its outputs do not lie along the channel axis
    if _readers(layers, i, bn.bottom[0]) != [unit.index]:
        return None
    return i


def _fold_into(target, arrays, a, c):
    """The target's arrays with the affine folded in (float64 math, stored dtype kept)."""
    weight = np.asarray(arrays[0], np.float64)
    dtype = np.asarray(arrays[0]).dtype
    if target.type == 'Convolution':
        scaled = weight * a.reshape((-1,) + (1,) * (weight.ndim - 1))
    elif target.type == 'Deconvolution':    # (C_in, C_out / group, kh, kw)
        groups = target.convolution_param.group
        shape = weight.shape
        grouped = weight.reshape((groups, shape[0] // groups) + shape[1:])
        per_group = a.reshape((groups, 1, shape[1]) + (1,) * (len(shape) - 2))
        scaled = (grouped * per_group).reshape(shape)
    elif target.inner_product_param.transpose:   # (K, N_out)
        scaled = weight * a.reshape(1, -1)
    else:                                      # (N_out, K)
        scaled = weight * a.reshape(-1, 1)
    bias = np.asarray(arrays[1], np.float64).reshape(-1) if len(arrays) > 1 else 0.0
    return [scaled.astype(dtype), (bias * a + c).astype(dtype)]


def _bias_on(target):
    """Set ``target``'s bias_term, and add a ParamSpec for the new bias if it lists specs."""
    field = 'inner_product_param' if target.type == 'InnerProduct' else 'convolution_param'
    params = getattr(target, field)
    if not params.bias_term:
        params.bias_term = True
        if len(target.param) == 1:
            target.param.add()


def _checked_against_the_net(param, weights, input_shape):
    """``param`` with its Input layers shaped by ``input_shape`` (when given), once the
    weights are found to fit the net it makes: its data layers' tops shaped by their
    sources, or by ``input_shape``."""
    shaped = with_inputs(param, input_shape)
    net = Net(shaped, TEST, context=LayerContext(phase=TEST, xp=np, dtype=np.float32))
    copy_checked(net, weights, 'fold_bn')
    if input_shape:
        for layer, reshaped in zip(param.layer, shaped.layer):
            if layer.type == 'Input':
                layer.CopyFrom(reshaped)
    return param


def fold_bn(net_param, weights, input_shape=None):
    """``(net_param, weights)`` of the TEST net with every batch norm folded (module
    docstring). ``weights`` (a caffemodel path or {layer name: [arrays]}) must hold the
    norms' statistics and the weights of the layers they fold into, and fit the net:
    its Input layers' shapes, or ``input_shape`` (N, C, H, W, which they then take), or
    the shapes its data layers' sources give."""
    if weights is None:
        raise CaffeError('fold_bn needs the weights: folding changes them')
    param = load_net_param(net_param)
    given, stored = weights, with_shared_params(read_weights(weights), param.layer)
    source, weights = stored.source, collections.OrderedDict(arrays_of(stored))
    param = filter_net(param, net_state(param, TEST))
    param.ClearField('state')
    param = _checked_against_the_net(param, given, input_shape)
    layers = list(param.layer)
    for layer in layers:
        if layer.type in ('BatchNorm', 'BN', 'SyncBN') and not weights.get(layer.name):
            raise CaffeError("fold_bn: %s holds nothing for batch norm '%s'"
                             % (source, layer.name))
    i = 0
    while i < len(layers):
        units = [u for u in norm_units(layers) if u.index == i]
        if not units or _uses_batch_statistics(layers[i]):
            i += 1
            continue
        unit = units[0]
        bn = layers[unit.index]
        scale = layers[unit.scale_index] if unit.scale_name is not None else None
        try:
            a, c, dtype = _affine(bn, weights[unit.name],
                                  weights.get(unit.scale_name) if scale is not None else None,
                                  stored_layout(weights[unit.name], unit))
        except ValueError as exc:
            raise CaffeError("fold_bn: %s: batch norm '%s': %s"
                             % (source, unit.name, exc)) from None
        output = (scale if scale is not None else bn).top[0]
        target = _foldable(layers, weights, unit)
        for name in (unit.name, unit.scale_name):
            weights.pop(name, None)
        if target is not None:
            folded = caffe_pb2.LayerParameter()
            folded.CopyFrom(layers[target])
            _bias_on(folded)
            folded.top[0] = output
            weights[folded.name] = _fold_into(folded, weights[folded.name], a, c)
            layers[target] = folded
            replacement = []
        else:
            affine = caffe_pb2.LayerParameter(name=unit.name, type='Scale', bottom=bn.bottom[:1],
                                              top=[output])
            affine.scale_param.bias_term = True
            weights[unit.name] = [a.astype(dtype), c.astype(dtype)]
            replacement = [affine]
            log.info("fold_bn: '%s' cannot fold into the layer before it; it becomes a Scale",
                     unit.name)
        drop = {unit.index, unit.scale_index} - {None}
        layers = layers[:i] + replacement + [l for k, l in enumerate(layers) if k > i and k not in drop]
        i += len(replacement)
    del param.layer[:]
    param.layer.extend(layers)
    return param, collections.OrderedDict((l.name, weights[l.name]) for l in layers
                                          if weights.get(l.name))
