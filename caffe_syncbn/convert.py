"""Net rewrites that keep the weights: every batch norm of a net becomes SyncBN.

``to_syncbn`` turns BVLC ``BatchNorm`` (with the ``Scale`` that follows it) and the
forks' ``BN`` into ``SyncBN``, whose four 1xCx1x1 blobs are slope, bias, running mean
and running var. Weights move along:
  BatchNorm [mean_sum, var_sum, s]  ->  running mean = mean_sum/s, running var = var_sum/s
                                        (both 0 when s == 0, as Caffe reads them)
  Scale [gamma, beta]               ->  slope, bias (a BatchNorm with no Scale gets slope 1,
                                        bias 0, both fixed)
  BN [slope, bias, mean, var]       ->  the same four blobs
The running variance is carried over as stored: BatchNorm's is unbiased, BN's biased.
"""
import numpy as np

from . import caffe_pb2
from .errors import CaffeError


def _consumers(layers, start, blob):
    """Indices of the layers after ``start`` that read ``blob`` before it is overwritten."""
    found = []
    for i in range(start + 1, len(layers)):
        if blob in layers[i].bottom:
            found.append(i)
        if blob in layers[i].top and blob not in layers[i].bottom:
            break
    return found


def _fusable_scale(layers, i):
    """The index of the Scale layer that only applies a per-channel affine to BatchNorm i."""
    top = layers[i].top[0]
    users = _consumers(layers, i, top)
    if not users:
        return None
    j = users[0]
    scale = layers[j]
    if scale.type != 'Scale' or len(scale.bottom) != 1 or scale.scale_param.axis != 1 \
            or scale.scale_param.num_axes != 1:
        return None
    in_place_chain = scale.top[0] == top
    if not in_place_chain and len(users) > 1:
        return None               # someone else reads the un-scaled blob: keep the Scale
    return j


def _syncbn_layer(bn, scale):
    layer = caffe_pb2.LayerParameter(name=bn.name, type='SyncBN')
    layer.bottom.append(bn.bottom[0])
    layer.top.append(scale.top[0] if scale is not None else bn.top[0])
    layer.include.extend(bn.include)
    layer.exclude.extend(bn.exclude)
    p = layer.bn_param
    if bn.type == 'BatchNorm':
        bp = bn.batch_norm_param
        p.eps = bp.eps
        p.momentum = bp.moving_average_fraction
        p.frozen = bp.use_global_stats if bp.HasField('use_global_stats') else False
    else:
        p.CopyFrom(bn.bn_param)
    if bn.type == 'BatchNorm':
        fixed = caffe_pb2.ParamSpec(lr_mult=0, decay_mult=0)
        p.slope_filler.type, p.slope_filler.value = 'constant', 1.0
        slope_spec = bias_spec = fixed
        if scale is not None:
            sp, specs = scale.scale_param, list(scale.param)
            if sp.HasField('filler'):
                p.slope_filler.CopyFrom(sp.filler)
            slope_spec = specs[0] if specs else caffe_pb2.ParamSpec()
            if sp.bias_term:
                if sp.HasField('bias_filler'):
                    p.bias_filler.CopyFrom(sp.bias_filler)
                bias_spec = specs[1] if len(specs) > 1 else caffe_pb2.ParamSpec()
        layer.param.extend([slope_spec, bias_spec, fixed, fixed])
    else:
        layer.param.extend(bn.param)
    return layer


def _convert_blobs(bn, scale, blobs):
    """SyncBN's four arrays from the BatchNorm (+ Scale) or BN arrays of ``blobs``."""
    own = blobs.get(bn.name)
    if own is None:
        return None
    if bn.type == 'BN':
        return [np.asarray(b).reshape(1, -1, 1, 1) for b in own]
    if len(own) != 3:
        raise CaffeError("BatchNorm '%s' has %d weight blobs, expected 3" % (bn.name, len(own)))
    mean_sum, var_sum, factor = (np.asarray(b, np.float64) for b in own)
    s = float(factor.reshape(-1)[0])
    inv = 0.0 if s == 0 else 1.0 / s
    channels = mean_sum.size
    if scale is not None and scale.name in blobs:
        gamma = np.asarray(blobs[scale.name][0]).reshape(-1)
        beta = np.asarray(blobs[scale.name][1]).reshape(-1) if len(blobs[scale.name]) > 1 \
            else np.zeros(channels)
    else:
        gamma, beta = np.ones(channels), np.zeros(channels)
    dtype = np.asarray(own[0]).dtype
    return [np.asarray(a, dtype).reshape(1, channels, 1, 1)
            for a in (gamma, beta, mean_sum * inv, var_sum * inv)]


def to_syncbn(net_param, weights=None):
    """Return ``(net_param, weights)`` with every BatchNorm(+Scale) and BN turned into SyncBN.

    net_param: a NetParameter (or prototxt path); weights: None, a caffemodel path, a
    NetParameter with blobs, or {layer name: [arrays]}. The weights come back as
    {layer name: [arrays]} ready for ``Net.copy_from``-style loading (or None).
    """
    from .io.caffemodel import layer_blobs, read_net_param
    from .net import load_net_param
    param = load_net_param(net_param)
    if weights is not None and not isinstance(weights, dict):
        source = read_net_param(weights) if not isinstance(weights, caffe_pb2.NetParameter) else weights
        weights = layer_blobs(source)
    layers = list(param.layer)
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    converted = dict(weights) if weights is not None else None
    absorbed = set()
    for i, layer in enumerate(layers):
        if i in absorbed:
            continue
        if layer.type not in ('BatchNorm', 'BN'):
            out.layer.add().CopyFrom(layer)
            continue
        j = _fusable_scale(layers, i) if layer.type == 'BatchNorm' else None
        scale = layers[j] if j is not None else None
        if j is not None:
            absorbed.add(j)
        out.layer.add().CopyFrom(_syncbn_layer(layer, scale))
        if converted is not None:
            blobs = _convert_blobs(layer, scale, weights)
            if blobs is not None:
                converted[layer.name] = blobs
            if scale is not None:
                converted.pop(scale.name, None)
    return out, converted
