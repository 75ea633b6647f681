"""The ONNX graph an export builds, and the registry of per-layer rules.

A rule turns one Caffe layer into ONNX nodes and returns one tensor name per top:

    @rule('TanH')
    def tanh(n):
        return [n.op('Tanh', n.inputs[0])]

It sees the layer through ``n``, a LayerExport: the built Layer (geometry, weights), the
tensors and shapes of its bottoms and tops, and helpers that add nodes and constants. The
exporter names what the rule returns after the layer's blobs (see model.py).
"""
import numpy as np
import onnx
from onnx import helper

from ..backend import to_numpy

_RULES = {}


def rule(*type_names):
    """Function decorator: the ONNX rule for the given Caffe layer types."""
    def add(fn):
        for name in type_names:
            if name in _RULES:
                raise ValueError('ONNX rule for %r registered twice' % name)
            _RULES[name] = fn
        return fn
    return add


def ruled_types():
    """The layer types that have a rule among the rule modules imported so far."""
    return sorted(_RULES)


def rule_for(type_name):
    """The rule for a Caffe layer type, or None."""
    return _RULES.get(type_name)


class Unsupported(Exception):
    """A rule cannot express this layer's configuration; the exporter reports them all."""


class Graph:
    """The nodes and initializers of one graph, and the names handed out so far.

    Blob names are reserved: ``claim`` gives one out once (to the tensor that must carry
    it), ``fresh`` never does, so internal tensors cannot take a name a user expects.
    """

    def __init__(self, opset, reserved):
        self.opset = opset
        self.nodes = []
        # initializers go straight into the model: weights can be hundreds of MB
        self.model = onnx.ModelProto()
        self._reserved = set(reserved)
        self._used = set()
        self._node_names = set()

    def fresh(self, base):
        name, k = base, 0
        while name in self._used or name in self._reserved:
            k += 1
            name = '%s_%d' % (base, k)
        self._used.add(name)
        return name

    def claim(self, name):
        if name in self._reserved:
            self._reserved.discard(name)
            self._used.add(name)
            return name
        return self.fresh(name)

    def node_name(self, base):
        name, k = base, 0
        while name in self._node_names:
            k += 1
            name = '%s_%d' % (base, k)
        self._node_names.add(name)
        return name


class LayerExport:
    """What a rule sees of one layer, and how it adds to the graph.

    layer:      the built Layer (its parsed geometry and ``blobs``)
    inputs:     the tensor name of each bottom
    in_shapes, out_shapes: bottom and top shapes, as our Net infers them
    batched:    the export has a symbolic batch and bottom 0's first axis is it
    """

    def __init__(self, graph, layer, inputs, in_shapes, out_shapes, batched):
        self.graph, self.layer, self.param = graph, layer, layer.param
        self.name = layer.param.name
        self.inputs, self.in_shapes, self.out_shapes = inputs, in_shapes, out_shapes
        self.batched = batched
        self.nodes = []

    @property
    def opset(self):
        return self.graph.opset

    def op(self, op_type, *inputs, outputs=1, **attrs):
        """Add a node; its output name, or a list of ``outputs`` names."""
        names = [self.graph.fresh('%s/%s' % (self.name, op_type)) for _ in range(outputs)]
        node = helper.make_node(op_type, list(inputs), names, **attrs)
        self.graph.nodes.append(node)
        self.nodes.append(node)
        return names[0] if outputs == 1 else names

    def const(self, value, what, dtype=np.float32):
        """An initializer holding ``value`` (as ``dtype``); its name."""
        value = np.asarray(value, np.dtype(dtype).newbyteorder('<'))
        tensor = self.graph.model.graph.initializer.add()
        tensor.name = self.graph.fresh('%s/%s' % (self.name, what))
        tensor.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        tensor.dims.extend(value.shape)
        tensor.raw_data = value.tobytes()
        return tensor.name

    def ints(self, values, what):
        return self.const(values, what, np.int64)

    def weight(self, index, shape=None, what=None):
        """Learned blob ``index`` as an initializer, reshaped to ``shape`` if given."""
        value = to_numpy(self.layer.blobs[index].data)
        if shape is not None:
            value = value.reshape(shape)
        return self.const(value, what or 'blob%d' % index)

    def reshape(self, x, shape, batched=None):
        """Reshape to ``shape``; with a symbolic batch its first axis is inferred (-1)."""
        batched = self.batched if batched is None else batched
        target = [-1] + list(shape[1:]) if batched else list(shape)
        return self.op('Reshape', x, self.ints(target, 'shape'))

    def reduce(self, op_type, x, axes, keepdims=1):
        """Reduce* over ``axes``: an input from opset 18 on (ReduceSum: 13), else an attribute."""
        if op_type == 'ReduceSum' or self.opset >= 18:
            return self.op(op_type, x, self.ints(list(axes), 'axes'), keepdims=keepdims)
        return self.op(op_type, x, axes=list(axes), keepdims=keepdims)

    def slice(self, x, starts, ends, axes, steps=None):
        inputs = [x, self.ints(starts, 'starts'), self.ints(ends, 'ends'), self.ints(axes, 'axes')]
        if steps is not None:
            inputs.append(self.ints(steps, 'steps'))
        return self.op('Slice', *inputs)

    def sizes_like(self, x, spatial):
        """An int64 (N, C, *spatial) shape tensor for Resize: N and C taken from ``x``."""
        if not self.batched:
            return self.ints(list(self.in_shapes[0][:2]) + list(spatial), 'sizes')
        leading = self.op('Shape', x, start=0, end=2)
        return self.op('Concat', leading, self.ints(list(spatial), 'spatial'), axis=0)
