"""The four forms of batch normalization, and rewrites of nets and weights between them.

A *norm unit* is one normalization of a net, in one of four forms:
  BatchNorm (BVLC), with the Scale that follows it if there is one: BatchNorm holds
      [mean_sum, var_sum, factor s], each (C,) and s (1,), and mean = mean_sum / s
      (0 when s == 0, as Caffe reads it); the Scale holds [gamma (C,), beta (C,)].
  NVCaffe's BatchNorm with scale_bias: [mean, var, 1, slope, bias], each (C,) but the 1
      (1,), which NVCaffe never reads (written as 1).
  BN (the PSPNet and yjxiong forks) and SyncBN: [slope, bias, mean, var], each 1xCx1x1;
      a SyncBN with ``statistics: BATCHNORM`` holds BatchNorm's sums in their place:
      [slope, bias, mean_sum, var_sum, s], s of shape (1,). Five stored blobs are NVCaffe's
      when the file's layer says so, or else when blob 2 holds one value and blob 4 more.
SegNet's and ENet's BN (kind ``SegNetBN``), which shares the type name BN, holds [scale,
shift] and no statistics: it is a unit of the net (-sync_bn converts it) but has no form to
move between, and the others' blobs do not load into it, nor its into them.
In TEST all four compute y = slope * (x - mean) / sqrt(var + eps) + bias, so weights move
between them through one per-channel record, ``NormStats``, and TEST outputs stay the same:
  - Between two forms that keep sums (BatchNorm, SyncBN with BATCHNORM statistics) the
    sums and s move as stored, bitwise: a SyncBN trained so writes Caffe's own blobs.
  - A BatchNorm without a Scale has slope 1 and bias 0, and cannot hold other values.
  - The running variance moves as stored. BatchNorm and SyncBN average the unbiased batch
    variance, the forks' BN the biased one (smaller by m/(m-1), m = N*H*W of a batch).
  - eps moves between batch_norm_param and bn_param, and moving_average_fraction is the
    momentum.
  - Written as sums from a mean and a variance (a BN's, a momentum SyncBN's), the
    statistics get the factor s = the power of two nearest 1 / (1 - moving_average_fraction),
    the value that Caffe's own s tends to as it trains (1024 for the default 0.999).
    Scaling by a power of two is exact, so TEST outputs are bitwise unchanged, and a stock
    Caffe that resumes training goes on averaging with about the right weight instead of
    restarting its sums.
"""
import collections
import math

import numpy as np

from .. import caffe_pb2
from ..errors import CaffeError
from ..formats.blobs import blob_shape
from ..formats.caffemodel import as_array
from ..formats.mapped import MappedBlob
from ..syncbn_policy import NVCAFFE_BATCHNORM, is_segnet_bn, keeps_sums, nvcaffe_form

NormUnit = collections.namedtuple('NormUnit',
                                  'kind name index scale_name scale_index keeps_sums')
#: ``sums``: BatchNorm's (mean_sum, var_sum, factor) as stored, or None
NormStats = collections.namedtuple('NormStats', 'mean var slope bias dtype sums')


#: how each layout of a normalization's own blobs reads: (blob count, [slope, bias] or
#: None, [mean, var] or [mean_sum, var_sum], the index of the factor s or None)
_LAYOUTS = {'BatchNorm': (3, None, (0, 1), 2), 'BN': (4, (0, 1), (2, 3), None),
            'sums': (5, (0, 1), (2, 3), 4), NVCAFFE_BATCHNORM: (5, (3, 4), (0, 1), None)}


def unit_layout(unit):
    """The layout (_LAYOUTS, or SegNet's BN's, which holds no statistics) of the blobs a
    unit stores under the normalization's name."""
    if unit.kind in ('BatchNorm', NVCAFFE_BATCHNORM, 'SegNetBN'):
        return unit.kind
    return 'sums' if unit.keeps_sums else 'BN'


def _count(item):
    if isinstance(item, MappedBlob):
        return item.count
    if isinstance(item, caffe_pb2.BlobProto):
        return int(np.prod(blob_shape(item), dtype=np.int64))
    return int(np.size(item))


def stored_layout(stored, origin=None):
    """The layout of a normalization's stored blobs: by their count, and for five by the
    unit ``origin`` they were written for, or else by which blob holds one value."""
    count = len(stored)
    if count != 5:
        return {2: 'SegNetBN', 3: 'BatchNorm', 4: 'BN'}.get(count)
    if origin is not None and unit_layout(origin) in ('sums', NVCAFFE_BATCHNORM):
        return unit_layout(origin)
    return NVCAFFE_BATCHNORM if _count(stored[2]) == 1 and _count(stored[4]) != 1 else 'sums'


# ---- finding the units ------------------------------------------------------------------
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
    top = layers[i].top[0] if layers[i].top else None
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


def norm_units(layers):
    """The norm units of a list of LayerParameters, in net order."""
    units = []
    for i, layer in enumerate(layers):
        if nvcaffe_form(layer):
            units.append(NormUnit(NVCAFFE_BATCHNORM, layer.name, i, None, None, False))
        elif layer.type == 'BatchNorm':
            j = _fusable_scale(layers, i)
            units.append(NormUnit('BatchNorm', layer.name, i,
                                  layers[j].name if j is not None else None, j, True))
        elif layer.type in ('BN', 'SyncBN'):
            kind = 'SegNetBN' if is_segnet_bn(layer) else layer.type
            units.append(NormUnit(kind, layer.name, i, None, None, keeps_sums(layer)))
    return units


# ---- one unit's weights -----------------------------------------------------------------
def stored_stats(arrays, scale_arrays=None, layout=None):
    """The NormStats of a unit's stored arrays in ``layout`` (by default as stored_layout
    finds it): 3 (BatchNorm, with ``scale_arrays`` the [gamma(, beta)] of its Scale), 4 (BN,
    SyncBN) or 5 (SyncBN with BATCHNORM statistics, NVCaffe's BatchNorm). Raises ValueError
    when they do not fit."""
    arrays = [np.asarray(a) for a in arrays]
    layout = layout or stored_layout(arrays)
    if layout in (None, 'SegNetBN'):
        raise ValueError("it has %d blobs; a batch norm has 3 (BatchNorm), 4 (BN, SyncBN) or 5 "
                         "(SyncBN with statistics: BATCHNORM, NVCaffe's BatchNorm with "
                         'scale_bias)%s' % (len(arrays), _SEGNET_HINT if len(arrays) == 2 else ''))
    flat = [a.astype(np.float64).reshape(-1) for a in arrays]
    _, affine, (first, second), factor_at = _LAYOUTS[layout]
    mean, var, sums = flat[first], flat[second], None
    if factor_at is not None:
        factor = flat[factor_at]
        if factor.size != 1:
            raise ValueError('its scale factor blob has %d values, expected 1' % factor.size)
        sums = mean, var, factor
        inverse = 0.0 if factor[0] == 0 else 1.0 / factor[0]
        mean, var = mean * inverse, var * inverse
    elif layout == NVCAFFE_BATCHNORM and flat[2].size != 1:
        raise ValueError('its variance correction blob has %d values, expected 1'
                         % flat[2].size)
    if affine is not None:
        slope, bias = flat[affine[0]], flat[affine[1]]
    else:
        scale = [np.asarray(a, np.float64).reshape(-1) for a in (scale_arrays or [])]
        slope = scale[0] if scale else np.ones_like(mean)
        bias = scale[1] if len(scale) > 1 else np.zeros_like(mean)
    sizes = {v.size for v in (mean, var, slope, bias)}
    if len(sizes) != 1:
        raise ValueError('its blobs disagree on the channel count: %s'
                         % sorted(v.size for v in (slope, bias, mean, var)))
    return NormStats(mean, var, slope, bias, arrays[0].dtype, sums)


_SEGNET_HINT = ("; 2 are the scale and shift of SegNet's or ENet's BN, which a prototxt names "
                'by bn_mode, scale_filler or shift_filler in bn_param')


def statistics_factor(fraction):
    """The BatchNorm scale factor written for a moving_average_fraction (module docstring)."""
    if not 0 < fraction < 1:
        return 1.0
    return 2.0 ** round(math.log2(1.0 / (1.0 - fraction)))


def _sums(stats, layer):
    """(mean_sum, var_sum, factor) of ``stats`` for a ``layer`` that keeps sums: as stored,
    or made with the factor of the layer's fraction."""
    if stats.sums is not None:
        return stats.sums
    s = statistics_factor(layer.batch_norm_param.moving_average_fraction
                          if layer.type == 'BatchNorm' else layer.bn_param.momentum)
    return stats.mean * s, stats.var * s, [s]


def unit_arrays(unit, stats, layers):
    """{layer name: arrays} holding ``stats`` in the form of ``unit`` (whose layers are
    ``layers``). Raises ValueError for an affine a Scale-less BatchNorm cannot hold."""
    cast = lambda v, shape: np.asarray(v, stats.dtype).reshape(shape)  # noqa: E731
    channels = stats.mean.size
    per_channel = (1, channels, 1, 1)
    if unit.kind == NVCAFFE_BATCHNORM:
        return {unit.name: [cast(stats.mean, channels), cast(stats.var, channels), cast(1, 1),
                            cast(stats.slope, channels), cast(stats.bias, channels)]}
    if unit.kind != 'BatchNorm':
        running = [(stats.mean, per_channel), (stats.var, per_channel)]
        if unit.keeps_sums:
            running = zip(_sums(stats, layers[unit.index]), [per_channel, per_channel, 1])
        return {unit.name: [cast(stats.slope, per_channel), cast(stats.bias, per_channel)]
                + [cast(v, shape) for v, shape in running]}
    mean_sum, var_sum, factor = _sums(stats, layers[unit.index])
    out = {unit.name: [cast(mean_sum, channels), cast(var_sum, channels), cast(factor, 1)]}
    has_bias = unit.scale_name is not None and layers[unit.scale_index].scale_param.bias_term
    if unit.scale_name is not None:
        out[unit.scale_name] = [cast(stats.slope, channels)] + \
            ([cast(stats.bias, channels)] if has_bias else [])
    lost = [what for what, values, neutral, kept in (
        ('slope', stats.slope, 1, unit.scale_name is not None),
        ('bias', stats.bias, 0, has_bias)) if not kept and np.any(values != neutral)]
    if lost:
        raise ValueError('its %s cannot be held by %s (%s)' % (
            ' and '.join(lost), "BatchNorm '%s'" % unit.name if unit.scale_name is None
            else "Scale '%s', which has no bias_term" % unit.scale_name,
            'no Scale follows it' if unit.scale_name is None else 'add bias_term: true'))
    return out


def fit_norm_weights(target_layers, blobs, source_layers=None, source='weights'):
    """``blobs`` ({layer name: stored blobs}) with every norm unit of ``target_layers`` that
    they hold in another form rewritten into the target's form.

    ``source_layers`` are the layers the blobs were written for: they tell which Scale goes
    with a stored BatchNorm. Without them a BatchNorm stored for a BN or SyncBN target is
    an error, as its Scale is unknown. ``source`` names the file in errors.
    """
    out = collections.OrderedDict(blobs)
    written_for = {u.name: u for u in norm_units(source_layers or [])}
    for unit in norm_units(target_layers):
        stored = blobs.get(unit.name)
        origin = written_for.get(unit.name)
        if not stored or stored_layout(stored, origin) == unit_layout(unit):
            continue
        scale_arrays = None
        if unit.kind == 'SegNetBN':
            raise CaffeError(
                "%s: layer '%s' is SegNet's BN here (2 blobs: scale and shift), but the file "
                "holds %d blobs for it: PSPNet's and SegNet's BN layers do not share weights"
                % (source, unit.name, len(stored)))
        if origin is not None and origin.kind == 'SegNetBN':
            raise CaffeError(
                "%s: layer '%s' holds SegNet's BN (scale and shift, no statistics), which "
                'loads into no %s' % (source, unit.name, unit.kind))
        if any(b is None for b in stored):
            raise CaffeError("%s: batch norm '%s' lacks blob %d"
                             % (source, unit.name, [b is None for b in stored].index(True)))
        if len(stored) == 3:
            if origin is None or origin.kind != 'BatchNorm':
                raise CaffeError(
                    "%s: layer '%s' holds BatchNorm statistics (3 blobs) but is a %s here (%d "
                    'blobs), and the file does not say which Scale layer goes with it: load it '
                    'with the prototxt it was written for'
                    % (source, unit.name, unit.kind, _LAYOUTS[unit_layout(unit)][0]))
            if origin.scale_name is not None:
                scale_arrays = [as_array(b) for b in blobs.get(origin.scale_name, [])
                                if b is not None]
        try:
            stats = stored_stats([as_array(b) for b in stored], scale_arrays,
                                 stored_layout(stored, origin))
            out.update(unit_arrays(unit, stats, target_layers))
        except ValueError as exc:
            raise CaffeError("%s: cannot load batch norm '%s' into the net's %s: %s"
                             % (source, unit.name, unit.kind, exc)) from None
    return out
