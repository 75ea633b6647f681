"""A net's inputs where it is converted, timed or exported: never guessed.

``with_inputs`` turns data layers into Input layers of the shapes their sources give
(data/top_shapes.py), or of the user's --input-shape. ``copy_checked`` loads weights into
a net and says a blob of the wrong shape in the terms that fit here: renaming the layer,
what training would suggest, is no remedy; either the weights are for another net, or the
net's inputs are not the ones they were trained on, and the line names the input that the
layer reads, with the flag that sizes it.
"""
from ..data.top_shapes import ASK, data_top_shapes
from ..errors import CaffeError, quote
from ..netparam.inputs import is_data_layer, swap_data_layers_for_inputs
from ..weights.copy import BlobShapeMismatch


def with_inputs(param, input_shape=None, batch=None):
    """A copy of ``param`` whose data layers are Input layers of the shapes their sources
    give, with first axis ``batch`` when given. ``input_shape`` (N, C, H, W) is instead
    the first top of every data and Input layer; the other tops follow from it."""
    shapes = {}
    for layer in param.layer:
        if is_data_layer(layer):
            shapes.update(zip(layer.top, data_top_shapes(layer, batch, input_shape)))
        elif layer.type == 'Input' and input_shape and layer.top:
            shapes[layer.top[0]] = tuple(input_shape)
    return swap_data_layers_for_inputs(param, shapes=shapes)


def copy_checked(net, weights, what):
    """``net.copy_from(weights)``; a blob of the wrong shape is one CaffeError, led by
    ``what``, that names the layer, the blob, both shapes and the inputs it depends on."""
    try:
        net.copy_from(weights)
    except BlobShapeMismatch as exc:
        raise CaffeError(_mismatch(net, exc, what)) from None


#: the axis of a layer's weights (blob 0) whose size its bottom's shape sets
_INPUT_AXIS = {'Convolution': 1, 'Deconvolution': 0, 'InnerProduct': 1}


def _shape_text(shape):
    return 'x'.join(map(str, shape)) if len(shape) else 'a scalar'


def _differing_axes(exc):
    if len(exc.file_shape) != len(exc.net_shape):
        return None
    return {k for k, (a, b) in enumerate(zip(exc.file_shape, exc.net_shape)) if a != b}


def _input_axis(layer, index):
    """The axis of blob ``index`` of ``layer`` that its input sets, or None where unknown."""
    if index != 0 or layer.type not in _INPUT_AXIS:
        return None
    if layer.type == 'InnerProduct' and layer.inner_product_param.transpose:
        return 0
    return _INPUT_AXIS[layer.type]


def _mismatch(net, exc, what):
    inputs = {name: net.blobs[name].shape for name in net.inputs}
    layer = net.layer_by_name[exc.layer].param
    line = ("%s: %s: layer '%s' blob %d has shape %s in the weights but %s in the net"
            % (what, exc.source, exc.layer, exc.index, exc.file_shape, exc.net_shape))
    axis, differing = _input_axis(layer, exc.index), _differing_axes(exc)
    if not inputs or (axis is not None and differing is not None and axis not in differing):
        return line + ': the weights are for another net'
    split_from = {top: l.param.bottom[0] for l in net.layers if l.param.type == 'Split'
                  for top in l.param.top}
    read = [split_from.get(b, b) for b in layer.bottom if split_from.get(b, b) in inputs]
    if axis is not None and differing == {axis} and read:
        return ("%s, which reads the net's input '%s' of shape %s: give the input shape the "
                'weights were trained on with --input-shape N,C,H,W'
                % (line, read[0], _shape_text(inputs[read[0]])))
    described = ', '.join('%s %s' % (quote(name), _shape_text(shape))
                          for name, shape in inputs.items())
    return ("%s: the weights are for another net, or were trained on inputs other than the "
            "net's (%s; %s)" % (line, described, ASK))
