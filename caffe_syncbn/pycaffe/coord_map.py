"""pycaffe's ``caffe.coord_map``: how coordinates move through NetSpec layers, so that FCN's
``crop(top, reference)`` finds the Crop offsets that align a score map with its input.

A map is (axis, scale, shift): input coordinate i lands on output coordinate i * scale +
shift, for every spatial axis from ``axis`` on (axis None: any, as for pointwise layers).
Convolution-like layers with stride s, kernel extent k and pad p map (1/s, (p - (k-1)/2) / s);
deconvolution (s, (k-1)/2 - p); Crop (1, -offset); pointwise layers (1, 0).
"""
import numpy as np

from ..errors import CaffeError
from .net_spec import layers as L

PASS_THROUGH_LAYERS = ['AbsVal', 'BatchNorm', 'Bias', 'BN', 'BNLL', 'Clip', 'Dropout', 'Eltwise',
                       'ELU', 'Exp', 'Log', 'LRN', 'MVN', 'Power', 'PReLU', 'ReLU', 'ReLU6',
                       'Scale', 'Sigmoid', 'Split', 'Swish', 'SyncBN', 'TanH', 'Threshold']


class CoordMapError(CaffeError, AssertionError, RuntimeError):
    """Tops that cannot be mapped or cropped (AssertionError and RuntimeError as in pycaffe)."""


class UndefinedMapException(CoordMapError):
    """The layer has no coordinate map (InnerProduct, global pooling, ...)."""


class AxisMismatchException(CoordMapError):
    """Two maps start at different axes."""


def _layer_params(fn, field):
    """A NetSpec layer's params, from ``field`` (e.g. 'convolution_param') when given as a dict."""
    return fn.params.get(field, fn.params)


def conv_params(fn):
    """(axis, stride, kernel extent, pad) of a Convolution, Deconvolution, Im2col or Pooling."""
    params = _layer_params(fn, 'pooling_param' if fn.type_name == 'Pooling' else 'convolution_param')
    legacy = {'kernel_h', 'kernel_w', 'stride_h', 'stride_w', 'pad_h', 'pad_w'} & set(params)
    if legacy:
        raise CoordMapError('coord_map: %s uses %s; give kernel_size/stride/pad instead'
                            % (fn.type_name, ', '.join(sorted(legacy))))
    if params.get('global_pooling') or 'kernel_size' not in params:
        raise UndefinedMapException('coord_map: %s without a kernel_size has no coordinate map'
                                    % fn.type_name)
    kernel = np.array(params['kernel_size'], ndmin=1)
    dilation = np.array(params.get('dilation', 1), ndmin=1)
    return (params.get('axis', 1), np.array(params.get('stride', 1), ndmin=1),
            (kernel - 1) * dilation + 1, np.array(params.get('pad', 0), ndmin=1))


def crop_params(fn):
    """(axis, offset) of a Crop layer, with Caffe's defaults (axis 2, offset 0)."""
    params = _layer_params(fn, 'crop_param')
    return params.get('axis', 2), np.array(params.get('offset', 0), ndmin=1)


def coord_map(fn):
    """The (axis, scale, shift) map from a layer's bottom to its top."""
    if fn.type_name in ('Convolution', 'Pooling', 'Im2col'):
        axis, stride, extent, pad = conv_params(fn)
        return axis, 1 / stride, (pad - (extent - 1) / 2) / stride
    if fn.type_name == 'Deconvolution':
        axis, stride, extent, pad = conv_params(fn)
        return axis, stride, (extent - 1) / 2 - pad
    if fn.type_name in PASS_THROUGH_LAYERS:
        return None, 1, 0
    if fn.type_name == 'Crop':
        axis, offset = crop_params(fn)
        return axis - 1, 1, -offset      # the map's axis counts the first cropped axis' predecessor
    raise UndefinedMapException('coord_map: layer type %s has no coordinate map' % fn.type_name)


def compose(base_map, next_map):
    """``next_map`` applied after ``base_map``: scales multiply, shifts add up scaled."""
    ax1, a1, b1 = base_map
    ax2, a2, b2 = next_map
    if ax1 is not None and ax2 is not None and ax1 != ax2:
        raise AxisMismatchException('coord_map: maps on axis %s and axis %s do not compose' % (ax1, ax2))
    return (ax2 if ax1 is None else ax1), a1 * a2, a1 * b2 + b1


def inverse(coord_map):
    """The map back from output to input coordinates."""
    ax, a, b = coord_map
    return ax, 1 / a, -b / a


def _mappable_bottoms(top):
    """The inputs a top's coordinates come from: a Crop's reference input does not count."""
    inputs = top.fn.inputs
    return inputs[:1] if top.fn.type_name == 'Crop' else inputs


def _ancestor_maps(top):
    """{ancestor top: map from it to ``top``}, through every layer with a map."""
    maps, frontier = {top: (None, 1, 0)}, [top]
    while frontier:
        current = frontier.pop()
        try:
            step = coord_map(current.fn)
        except UndefinedMapException:
            continue
        for bottom in _mappable_bottoms(current):
            maps[bottom] = compose(maps[current], step)
            frontier.append(bottom)
    return maps


def coord_map_from_to(top_from, top_to):
    """The map from ``top_from``'s coordinates to ``top_to``'s, through a common ancestor."""
    from_maps = _ancestor_maps(top_from)
    to_maps, frontier = {top_to: (None, 1, 0)}, [top_to]
    while frontier:
        current = frontier.pop()
        if current in from_maps:
            return compose(to_maps[current], inverse(from_maps[current]))
        try:
            step = coord_map(current.fn)
        except UndefinedMapException:
            continue
        for bottom in _mappable_bottoms(current):
            to_maps[bottom] = compose(to_maps[current], step)
            frontier.append(bottom)
    raise CoordMapError('coord_map: the tops share no input through spatial layers, so their '
                        'coordinates cannot be related')


def crop(top_from, top_to):
    """A Crop layer (NetSpec top) cutting ``top_from`` to ``top_to``'s extent, aligned."""
    ax, a, b = coord_map_from_to(top_from, top_to)
    a, b = np.array(a, ndmin=1), np.array(b, ndmin=1)
    if not (a == 1).all():
        raise CoordMapError('crop: the tops differ in scale (a = %s); the one cropped needs the '
                            "reference's resolution" % a)
    if not (b <= 0).all():
        raise CoordMapError('crop: the top would need a negative offset (b = %s): it is smaller '
                            'than the reference' % b)
    if not (np.round(b) == b).all():
        raise CoordMapError('crop: the offset is not a whole number of pixels (b = %s)' % b)
    return L.Crop(top_from, top_to, crop_param=dict(axis=ax + 1, offset=[int(-v) for v in b]))
