"""A train_val or test prototxt turned into a deploy one.

The TEST phase's rules are applied (with the given stages). Data layers become Input
layers: the image top gets ``input_shape``, or the shape the data layer itself would give
it, read from its source (data/top_shapes.py: the first record, image or dataset, the
crop, the batch size); where that source cannot be read, the conversion stops and asks
for the shape. SoftmaxWithLoss
becomes Softmax with top 'prob'. Accuracy (DeepLab's SegAccuracy too), every other loss,
DeepLab's MatWrite (which writes a test run's scores to files), and any layer that reads a
label (a data layer's second or later top) are dropped, with the layers that depend on
them. What a dropped loss read stays, as an output of the net. Weights are kept for the
layers that remain.
"""
import collections

from .. import caffe_pb2
from ..data.top_shapes import data_top_shapes
from ..formats.caffemodel import read_weights
from ..layer import TEST, layer_class
from ..netparam.graph import filter_net, net_state
from ..netparam.inputs import is_data_layer, swap_data_layers_for_inputs
from ..netparam.upgrade import load_net_param
from ..weights.copy import arrays_of, with_shared_params


#: the layers of a test run that a deploy net leaves out, besides the losses
_SCORING = ('Accuracy', 'SegAccuracy', 'MatWrite')


def _is_loss(layer):
    try:
        return layer_class(layer.type).is_loss
    except Exception:              # an unknown type: not ours to judge
        return False


def _softmax_for(loss, taken):
    name = 'prob' if 'prob' not in taken else loss.name + '_prob'
    while name in taken:
        name += '_'
    taken.add(name)
    layer = caffe_pb2.LayerParameter(name=name, type='Softmax', bottom=loss.bottom[:1], top=[name])
    if loss.HasField('softmax_param'):
        layer.softmax_param.CopyFrom(loss.softmax_param)
    return layer


def _without_dependents(layers, labels):
    """``layers`` without those that read a label or a blob that only dropped layers made."""
    while True:
        produced = {t for layer in layers for t in layer.top}
        keep = [layer for layer in layers
                if not any(b in labels or b not in produced for b in layer.bottom)]
        if len(keep) == len(layers):
            return keep
        layers = keep


def to_deploy(net_param, weights=None, input_shape=None, stages=()):
    """``(net_param, weights)`` of the deploy net (module docstring). ``input_shape``
    (N, C, H, W) sizes the first top of every data and Input layer; without it, each data
    layer's tops take the shapes its source gives."""
    param = load_net_param(net_param)
    written_for = list(param.layer)
    param = filter_net(param, net_state(param, TEST, stages=stages))
    param.ClearField('state')
    data_layers = [layer for layer in param.layer if is_data_layer(layer)]
    images = [layer.top[0] for layer in param.layer
              if layer.top and (layer.type == 'Input' or is_data_layer(layer))]
    labels = {top for layer in data_layers for top in layer.top[1:]}
    if input_shape:
        shapes = {top: tuple(input_shape) for top in images}
    else:
        shapes = {top: shape for layer in data_layers
                  for top, shape in zip(layer.top, data_top_shapes(layer))}
    param = swap_data_layers_for_inputs(param, shapes=shapes)
    taken = {layer.name for layer in param.layer} | {t for layer in param.layer for t in layer.top}
    layers = []
    for layer in param.layer:
        layer.ClearField('include')
        layer.ClearField('exclude')
        if layer.type == 'SoftmaxWithLoss':
            layers.append(_softmax_for(layer, taken))
        elif layer.type not in _SCORING and not _is_loss(layer):
            layers.append(layer)
    layers = _without_dependents(layers, labels)
    for layer in layers:           # Input layers drop their label tops (and shapes)
        if layer.type == 'Input' and labels & set(layer.top):
            keep = [k for k, top in enumerate(layer.top) if top not in labels]
            shapes = list(layer.input_param.shape)
            tops = [layer.top[k] for k in keep]
            del layer.top[:]
            layer.top.extend(tops)
            if len(shapes) > 1:
                del layer.input_param.shape[:]
                layer.input_param.shape.extend(shapes[k] for k in keep)
    layers = [layer for layer in layers if layer.top or layer.bottom]
    del param.layer[:]
    param.layer.extend(layers)
    if weights is None:
        return param, None
    arrays = arrays_of(with_shared_params(read_weights(weights), written_for))
    return param, collections.OrderedDict((l.name, arrays[l.name]) for l in layers
                                          if arrays.get(l.name))
