"""Rewrites of nets between the forms of batch normalization (see weights/norm_forms.py):
to_syncbn and to_batchnorm."""
import collections

from .. import caffe_pb2
from ..errors import CaffeError
from ..formats.caffemodel import read_weights
from ..netparam.upgrade import load_net_param
from ..syncbn_policy import (CONVERTED, is_frozen, is_segnet_bn, norm_eps, nvcaffe_form,
                              syncbn_statistics)
from ..weights.copy import arrays_of, with_shared_params
from ..weights.norm_forms import fit_norm_weights, norm_units


# ---- rewrites of nets -------------------------------------------------------------------
def _kept(layers, weights):
    """The weights of ``layers`` that have any, in net order (or None)."""
    if weights is None:
        return None
    return collections.OrderedDict((layer.name, weights[layer.name]) for layer in layers
                                   if weights.get(layer.name))


def _fitted(out, weights, source_layers):
    if weights is None:
        return None
    stored = with_shared_params(read_weights(weights), source_layers)
    fitted = fit_norm_weights(list(out.layer), stored.blobs, stored.layers or source_layers,
                              stored.source)
    return arrays_of(stored._replace(blobs=fitted))


def _syncbn_layer(bn, scale):
    layer = caffe_pb2.LayerParameter(name=bn.name, type='SyncBN')
    layer.bottom.append(bn.bottom[0])
    layer.top.append(scale.top[0] if scale is not None else bn.top[0])
    layer.include.extend(bn.include)
    layer.exclude.extend(bn.exclude)
    p = layer.bn_param
    fixed = caffe_pb2.ParamSpec(lr_mult=0, decay_mult=0)
    if nvcaffe_form(bn):
        return _nvcaffe_syncbn(bn, layer)
    if bn.type != 'BatchNorm':
        layer.top.extend(bn.top[1:])          # SegNet's BN: the batch mean and variance
        p.CopyFrom(bn.bn_param)
        # the forks' frozen BN fixes slope and bias; a frozen SyncBN follows its ParamSpecs
        layer.param.extend([fixed, fixed] if p.frozen else bn.param)
        return layer
    bp = bn.batch_norm_param
    p.eps = bp.eps
    p.statistics = syncbn_statistics(bn)
    p.momentum = bp.moving_average_fraction
    p.frozen = is_frozen(bn)
    p.slope_filler.type, p.slope_filler.value = 'constant', 1.0
    if scale is None:
        layer.param.extend([fixed, fixed])
        return layer
    sp, specs = scale.scale_param, list(scale.param)
    if sp.HasField('filler'):
        p.slope_filler.CopyFrom(sp.filler)
    learned = [specs[0] if specs else caffe_pb2.ParamSpec()]
    if sp.bias_term:
        if sp.HasField('bias_filler'):
            p.bias_filler.CopyFrom(sp.bias_filler)
        learned.append(specs[1] if len(specs) > 1 else caffe_pb2.ParamSpec())
    else:
        learned.append(fixed)
    if any(spec.ListFields() for spec in learned):   # else SyncBN's defaults say the same
        layer.param.extend(learned)
    return layer


def _nvcaffe_syncbn(bn, layer):
    """``layer`` (a SyncBN) as NVCaffe's BatchNorm ``bn`` runs: its statistics, engine and
    least eps, its fillers, and its scale and bias learned at lr_mult and decay_mult 1, as
    NVCaffe sets them whatever its prototxt says."""
    bp, p = bn.batch_norm_param, layer.bn_param
    p.eps, p.momentum, p.engine = norm_eps(bn), bp.moving_average_fraction, bp.engine
    p.statistics = syncbn_statistics(bn)
    if bp.HasField('scale_filler'):
        p.slope_filler.CopyFrom(bp.scale_filler)
    else:
        p.slope_filler.type, p.slope_filler.value = 'constant', 1.0
    if bp.HasField('bias_filler'):
        p.bias_filler.CopyFrom(bp.bias_filler)
    layer.param.extend([caffe_pb2.ParamSpec(lr_mult=1, decay_mult=1)] * 2)
    return layer


def to_syncbn(net_param, weights=None):
    """``(net_param, weights)`` with every BatchNorm(+Scale) and BN turned into SyncBN, each
    keeping the statistics of the layer it was (syncbn_policy: what converts, and how).

    net_param: a NetParameter or prototxt path; weights: None, a caffemodel path (binary or
    HDF5), a NetParameter with blobs, or {layer name: [arrays]}. The weights come back as
    {layer name: [arrays]} for the layers of the new net (or None).
    """
    param = load_net_param(net_param)
    layers = list(param.layer)
    paired = [u for u in norm_units(layers) if u.scale_index is not None]
    absorbed = {u.scale_index for u in paired}
    scales = {u.index: layers[u.scale_index] for u in paired}
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    for i, layer in enumerate(layers):
        if i in absorbed:
            continue
        if layer.type in CONVERTED:
            out.layer.add().CopyFrom(_syncbn_layer(layer, scales.get(i)))
        else:
            out.layer.add().CopyFrom(layer)
    return out, _kept(out.layer, _fitted(out, weights, layers))


def _unique_name(wanted, taken):
    name, k = wanted, 1
    while name in taken:
        k += 1
        name = '%s_%d' % (wanted, k)
    taken.add(name)
    return name


def _batchnorm_layers(norm, scale_name):
    """BatchNorm + Scale (in place on the BatchNorm's top) for a BN or SyncBN layer."""
    p = norm.bn_param
    bn = caffe_pb2.LayerParameter(name=norm.name, type='BatchNorm', bottom=norm.bottom,
                                  top=norm.top, include=norm.include, exclude=norm.exclude)
    bn.batch_norm_param.eps = p.eps
    bn.batch_norm_param.moving_average_fraction = p.momentum
    if p.frozen:
        bn.batch_norm_param.use_global_stats = True
    scale = caffe_pb2.LayerParameter(name=scale_name, type='Scale', bottom=norm.top,
                                     top=norm.top, include=norm.include, exclude=norm.exclude)
    scale.scale_param.bias_term = True
    # an unset slope_filler fills BN's slope with 0, as Scale's constant filler with value 0
    scale.scale_param.filler.CopyFrom(p.slope_filler)
    if p.HasField('bias_filler'):
        scale.scale_param.bias_filler.CopyFrom(p.bias_filler)
    if norm.type == 'BN' and p.frozen:        # the forks' frozen BN fixes slope and bias
        scale.param.extend([caffe_pb2.ParamSpec(lr_mult=0, decay_mult=0)] * 2)
    else:
        scale.param.extend(norm.param[:2])
    return bn, scale


def _segnet_scale_layer(norm):
    """The Scale that SegNet's BN in INFERENCE mode is (y = scale * x + shift)."""
    if norm.bn_param.bn_mode != caffe_pb2.BNParameter.INFERENCE:
        raise CaffeError("to_batchnorm: layer '%s' is SegNet's BN in LEARN mode, which "
                         "normalizes with each batch's statistics in every phase and keeps "
                         "none: fold the statistics of your data into its scale and shift "
                         "(SegNet's compute_bn_statistics) and set bn_mode: INFERENCE first"
                         % norm.name)
    scale = caffe_pb2.LayerParameter(name=norm.name, type='Scale', bottom=norm.bottom,
                                     top=norm.top, include=norm.include, exclude=norm.exclude,
                                     param=norm.param[:2])
    scale.scale_param.bias_term = True
    scale.scale_param.filler.CopyFrom(norm.bn_param.scale_filler)
    scale.scale_param.bias_filler.CopyFrom(norm.bn_param.shift_filler)
    return scale


def _nvcaffe_batchnorm_layers(norm, scale_name):
    """BVLC BatchNorm + Scale (in place on its top) for NVCaffe's BatchNorm ``norm``."""
    bn = caffe_pb2.LayerParameter()
    bn.CopyFrom(norm)
    bn.ClearField('param')
    bp = bn.batch_norm_param
    bp.eps = norm_eps(norm)
    for name in ('scale_filler', 'bias_filler', 'scale_bias', 'engine', 'use_global_stats'):
        bp.ClearField(name)
    scale = caffe_pb2.LayerParameter(name=scale_name, type='Scale', bottom=norm.top,
                                     top=norm.top, include=norm.include, exclude=norm.exclude)
    scale.scale_param.bias_term = True
    scale.scale_param.filler.type, scale.scale_param.filler.value = 'constant', 1.0
    p = norm.batch_norm_param
    if p.HasField('scale_filler'):
        scale.scale_param.filler.CopyFrom(p.scale_filler)
    if p.HasField('bias_filler'):
        scale.scale_param.bias_filler.CopyFrom(p.bias_filler)
    scale.param.extend([caffe_pb2.ParamSpec(lr_mult=1, decay_mult=1)] * 2)
    return bn, scale


def to_batchnorm(net_param, weights=None):
    """``(net_param, weights)`` with every BN, SyncBN and NVCaffe BatchNorm turned into BVLC
    BatchNorm followed by an in-place Scale named '<name>_scale' (frozen ones get
    use_global_stats: true), which stock Caffe and OpenCV run; SegNet's BN in INFERENCE
    mode becomes the Scale alone. Arguments and result as for ``to_syncbn``."""
    param = load_net_param(net_param)
    layers = list(param.layer)
    taken = {layer.name for layer in layers}
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    scales = set()
    for layer in layers:
        if is_segnet_bn(layer):
            out.layer.add().CopyFrom(_segnet_scale_layer(layer))
            scales.add(layer.name)
        elif layer.type in ('BN', 'SyncBN'):
            out.layer.extend(_batchnorm_layers(layer, _unique_name(layer.name + '_scale', taken)))
        elif nvcaffe_form(layer):
            out.layer.extend(_nvcaffe_batchnorm_layers(
                layer, _unique_name(layer.name + '_scale', taken)))
        else:
            out.layer.add().CopyFrom(layer)
    kept = _kept(out.layer, _fitted(out, weights, layers))
    for name in scales & set(kept or ()):
        kept[name] = [array.reshape(-1) for array in kept[name]]    # Scale's are (C,)
    return out, kept
