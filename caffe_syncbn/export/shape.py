"""Rules for the layers that route, reshape, combine or select values, and the sources
(Input, Parameter, constant DummyData)."""
import numpy as np
from onnx import TensorProto

from .. import caffe_pb2
from .graph import Unsupported, rule

INT64_MIN = np.iinfo(np.int64).min


@rule('Input')
def input_layer(n):
    return list(n.param.top)         # the graph inputs, named by the exporter


@rule('Split')
def split(n):
    return [n.inputs[0]] * len(n.param.top)


@rule('Silence')
def silence(n):
    return []


@rule('Parameter')
def parameter(n):
    return [n.weight(0, what='value')]


@rule('DummyData')
def dummy_data(n):
    if any(f.type != 'constant' for f in n.layer.fillers):
        raise Unsupported('random fillers are drawn anew on every forward')
    return [n.const(np.full(shape, f.value), 'value')
            for shape, f in zip(n.out_shapes, n.layer.fillers)]


@rule('Concat')
def concat(n):
    return [n.op('Concat', *n.inputs, axis=n.layer.axis)]


def _refuse_batch_axis(n, axis, what):
    if axis == 0 and n.batched:
        raise Unsupported('%s along axis 0 cannot have a symbolic batch' % what)


@rule('Slice')
def slice_layer(n):
    layer = n.layer
    _refuse_batch_axis(n, layer.axis, 'slicing')
    sizes = [shape[layer.axis] for shape in n.out_shapes]
    if len(sizes) == 1:
        return [n.inputs[0]]
    return n.op('Split', n.inputs[0], n.ints(sizes, 'split'), outputs=len(sizes),
                axis=layer.axis)


@rule('Flatten', 'Reshape')
def reshape(n):
    return [n.reshape(n.inputs[0], n.out_shapes[0])]


@rule('Crop')
def crop(n):
    window = n.layer.window
    axes = [i for i, w in enumerate(window) if w != slice(None)]
    if not axes:
        return [n.inputs[0]]
    _refuse_batch_axis(n, axes[0], 'cropping')
    return [n.slice(n.inputs[0], [window[i].start for i in axes],
                    [window[i].stop for i in axes], axes)]


@rule('Tile')
def tile(n):
    repeats = [1] * len(n.in_shapes[0])
    repeats[n.layer.axis] = n.layer.tiles
    return [n.op('Tile', n.inputs[0], n.ints(repeats, 'repeats'))]


@rule('Eltwise')
def eltwise(n):
    ops = caffe_pb2.EltwiseParameter
    layer = n.layer
    if layer.op == ops.PROD:
        y = n.inputs[0]
        for x in n.inputs[1:]:
            y = n.op('Mul', y, x)
        return [y]
    if layer.op == ops.MAX:
        return [n.op('Max', *n.inputs)]
    terms = [x if c == 1 else n.op('Mul', x, n.const(c, 'coeff'))
             for x, c in zip(n.inputs, layer.coeff)]
    return [n.op('Sum', *terms)]


@rule('ArgMax')
def argmax(n):
    """Caffe's top_k with ties to the LARGER index: TopK (ties to the smaller index) of the
    reversed axis, whose indices are then mirrored back."""
    layer, x = n.layer, n.inputs[0]
    shape = n.in_shapes[0]
    if layer.axis is None:
        axis, x = 1, n.op('Flatten', x, axis=1)
        length = int(np.prod(shape[1:]))
    else:
        axis, length = layer.axis, shape[layer.axis]
    reversed_x = n.slice(x, [-1], [INT64_MIN], [axis], [-1])
    values, reversed_index = n.op('TopK', reversed_x, n.ints([layer.top_k], 'k'), outputs=2,
                                  axis=axis, largest=1, sorted=1)
    index = n.op('Sub', n.ints(length - 1, 'last'), reversed_index)
    index = n.op('Cast', index, to=TensorProto.FLOAT)
    out_max_val = n.param.argmax_param.out_max_val
    if layer.axis is not None:
        return [values if out_max_val else index]
    if out_max_val:      # (N, 2, top_k): the indices, then the values
        rows = [n.op('Unsqueeze', r, n.ints([1], 'axes')) for r in (index, values)]
        index = n.op('Concat', *rows, axis=1)
    return [n.reshape(index, n.out_shapes[0])]


@rule('Reduction')
def reduction(n):
    ops = caffe_pb2.ReductionParameter
    p = n.param.reduction_param
    axes = list(range(n.layer.axis, len(n.in_shapes[0])))
    op_type = {ops.SUM: 'ReduceSum', ops.ASUM: 'ReduceL1', ops.SUMSQ: 'ReduceSumSquare',
               ops.MEAN: 'ReduceMean'}[p.operation]
    y = n.reduce(op_type, n.inputs[0], axes, keepdims=0)
    return [y if p.coeff == 1 else n.op('Mul', y, n.const(p.coeff, 'coeff'))]


@rule('BatchReindex')
def batch_reindex(n):
    return [n.op('Gather', n.inputs[0], n.op('Cast', n.inputs[1], to=TensorProto.INT64), axis=0)]

