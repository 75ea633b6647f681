"""to_onnx: a deploy net and its weights as an ONNX model.

Our Net, built in TEST phase, is the reference: it infers every blob's shape and holds the
weights the rules read. Caffe's in-place layers write one blob several times; ONNX tensors
are written once, so each write gets a tensor of its own and the LAST write of a blob
carries the blob's name (graph outputs are the net's outputs, by name).
"""
import numpy as np
import onnx
from onnx import TensorProto, helper

from .. import caffe_pb2
from ..convert.inputs import copy_checked
from ..errors import CaffeError
from ..layer import TEST, LayerContext
from ..net import Net
from ..netparam.graph import filter_net, net_state
from ..netparam.upgrade import load_net_param
# the rule modules register their rules as they are imported (shape's under another
# name: this module's functions name blob shapes so)
from . import conv, detection, forks, neuron, norm, vision  # noqa: F401
from . import shape as shape_rules  # noqa: F401
from .graph import Graph, LayerExport, Unsupported, rule_for, ruled_types

MIN_OPSET = 17

# why a family of layer types has no ONNX rule, for the error message
_HINTS = (
    (lambda t: t.endswith('Loss') or t in ('Accuracy', 'SegAccuracy'),
     'a training layer: export a deploy net'),
    (lambda t: t in ('Data', 'ImageData', 'HDF5Data', 'MemoryData', 'WindowData', 'SegData',
                     'ImageSegData', 'DenseImageData', 'MatRead'),
     'reads data: replace it with an Input layer'),
    (lambda t: t in ('HDF5Output', 'MatWrite'), 'writes files: export a deploy net'),
    (lambda t: t == 'Python', 'runs Python code'),
    (lambda t: t in ('LSTM', 'RNN', 'LSTMUnit'), "Caffe's recurrent layers have no ONNX rule"),
    (lambda t: t == 'Filter', 'its output size depends on the data'),
)


def to_onnx(net_param, weights=None, input_shapes=None, opset=MIN_OPSET, dynamic_batch=False,
            outputs=None):
    """The ONNX ModelProto of a deploy net, checked with ``onnx.checker``.

    net_param:     NetParameter or prototxt path (V1 and legacy ``input:`` fields are
                   upgraded); its Input layers become the graph inputs
    weights:       None, a caffemodel path (binary or HDF5), a NetParameter with blobs, or
                   {layer name: [arrays]} as the converters give it; loaded as
                   ``Net.copy_from`` loads (batch norms stored in another form are
                   converted); layers without weights keep their filler values
    input_shapes:  {input blob: shape} overriding the prototxt's Input shapes
    opset:         ONNX opset, >= 17
    dynamic_batch: make the first axis of every input and output symbolic
    outputs:       the blobs the model gives (default: the net's outputs); the layers
                   that none of them needs are left out, so a net exports up to a layer
                   ONNX cannot express
    """
    max_opset = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= max_opset:
        raise CaffeError('ONNX opset %d is not supported: give %d to %d (the installed onnx '
                         'knows up to %d)' % (opset, MIN_OPSET, max_opset, max_opset))
    param = _with_input_shapes(load_net_param(net_param), input_shapes or {})
    if outputs:
        param = _needed_for(param, list(outputs))
    _refuse_types_without_rule(param)
    net = Net(param, TEST, context=LayerContext(phase=TEST, xp=np, dtype=np.float32))
    if weights is not None:
        copy_checked(net, weights, 'to_onnx')
    batch_axes = _batch_trace(net) if dynamic_batch else {}
    model = _export(net, opset, batch_axes, list(outputs) if outputs else net.outputs)
    onnx.checker.check_model(model, full_check=True)
    return model


def _with_input_shapes(param, input_shapes):
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    inputs = {top: layer for layer in out.layer if layer.type == 'Input' for top in layer.top}
    unknown = sorted(set(input_shapes) - set(inputs))
    if unknown:
        raise CaffeError('input_shapes names %s, which %s not an Input blob of net %r (inputs: %s)'
                         % (', '.join(unknown), 'is' if len(unknown) == 1 else 'are',
                            out.name, ', '.join(inputs) or 'none'))
    for name, shape in input_shapes.items():
        ip = inputs[name].input_param
        tops = list(inputs[name].top)
        if len(ip.shape) == 1 and len(tops) > 1:       # one shape shared by every top
            ip.shape.extend([ip.shape[0]] * (len(tops) - 1))
        while len(ip.shape) < len(tops):
            ip.shape.add()
        del ip.shape[tops.index(name)].dim[:]
        ip.shape[tops.index(name)].dim.extend(int(d) for d in shape)
    return out


def _needed_for(param, outputs):
    """The TEST net of ``param`` with only the layers that ``outputs`` need (every layer
    that writes a needed blob, the last value of a blob being its value)."""
    net = filter_net(param, net_state(param, TEST))
    produced = {top for layer in net.layer for top in layer.top}
    unknown = [name for name in outputs if name not in produced]
    if unknown:
        raise CaffeError("outputs: net '%s' has no blob %s (blobs: %s)"
                         % (net.name, ', '.join(map(repr, unknown)), ', '.join(sorted(produced))))
    needed, kept = set(outputs), []
    for layer in reversed(net.layer):
        if needed & set(layer.top):
            needed.update(layer.bottom)
            kept.append(layer)
    del net.layer[:]
    net.layer.extend(reversed(kept))
    return net


def _refuse_types_without_rule(param):
    """Before building anything: one error naming every layer whose type has no rule."""
    missing = [(lp, _hint(lp.type)) for lp in filter_net(param, net_state(param, TEST)).layer
               if rule_for(lp.type) is None]
    if missing:
        raise _refusal(param.name, missing)


def _hint(type_name):
    return next((text for test, text in _HINTS if test(type_name)), 'no ONNX counterpart')


def _refusal(net_name, refused):
    listing = '; '.join("'%s' (%s): %s" % (lp.name, lp.type, why) for lp, why in refused)
    return CaffeError('cannot export %s to ONNX: %d layer(s) cannot be expressed: %s'
                      % ("net '%s'" % net_name if net_name else 'the net', len(refused), listing))


def _batch_trace(net):
    """{blob: whether its first axis is the batch}, from the shapes at batch B and 2B.

    A blob whose other axes change with the batch cannot have a symbolic batch: refused.
    """
    first = {name: blob.shape for name, blob in net.blobs.items()}

    def reshape_inputs(factor):
        for name in net.inputs:
            shape = first[name]
            net.blobs[name].reshape((shape[0] * factor,) + shape[1:])
        net.reshape()

    batch = first[net.inputs[0]][0] if net.inputs else 1
    try:
        reshape_inputs(2)
    except CaffeError as exc:
        raise CaffeError('cannot export with a dynamic batch: at batch size %d, %s'
                         % (2 * batch, exc)) from None
    second = {name: blob.shape for name, blob in net.blobs.items()}
    reshape_inputs(1)
    producer = {}
    for lp in net.net_param.layer:
        for top in lp.top:
            producer.setdefault(top, lp)
    batched = {}
    for name, shape in first.items():
        other = second[name]
        if shape == other:
            batched[name] = False
        elif shape[1:] == other[1:] and len(shape) == len(other):
            batched[name] = True
        else:
            lp = producer[name]
            raise CaffeError("cannot export with a dynamic batch: layer '%s' (type %s) gives blob "
                             "'%s' the shape %s at batch size %d and %s at %d"
                             % (lp.name, lp.type, name, list(shape), batch, list(other),
                                2 * batch))
    return batched


def _export(net, opset, batched, output_blobs):
    graph = Graph(opset, reserved=net.blobs)
    for name in net.inputs:             # graph inputs keep their blob names
        graph.claim(name)
    layers = list(zip(net.net_param.layer, net.layers))
    last_write = {top: i for i, (lp, _) in enumerate(layers) for top in lp.top}
    tensors, refused = {}, []
    for i, (lp, layer) in enumerate(layers):
        if any(tensors.get(b) is None for b in lp.bottom):
            for top in lp.top:          # downstream of a refused layer
                tensors[top] = None
            continue
        inputs = [tensors[b] for b in lp.bottom]
        in_shapes = [net.blobs[b].shape for b in lp.bottom]
        out_shapes = [net.blobs[t].shape for t in lp.top]
        n = LayerExport(graph, layer, inputs, in_shapes, out_shapes,
                        bool(lp.bottom) and batched.get(lp.bottom[0], False))
        try:
            outputs = rule_for(lp.type)(n)
        except Unsupported as exc:
            refused.append((lp, str(exc)))
            for top in lp.top:
                tensors[top] = None
            continue
        for j, (top, tensor) in enumerate(zip(lp.top, outputs)):
            if _made_by(n, tensor) and tensor not in outputs[:j]:    # else an alias
                name = graph.claim(top) if last_write[top] == i else \
                    graph.fresh('%s/%s' % (top, lp.name))
                _rename(n, tensor, name)
                tensor = name
            tensors[top] = tensor
        _name_nodes(graph, n, tensors[lp.top[0]] if lp.top else None)
    if refused:
        raise _refusal(net.name, refused)
    return _model(net, graph, tensors, batched, output_blobs)


def _made_by(n, tensor):
    return any(tensor in node.output for node in n.nodes)


def _rename(n, tensor, name):
    for node in n.nodes:
        for field in (node.input, node.output):
            for k, value in enumerate(field):
                if value == tensor:
                    field[k] = name


def _name_nodes(graph, n, main_output):
    """The node that writes top 0 is named after the layer; its helpers after layer/op."""
    for node in n.nodes:
        base = n.name if main_output in node.output else '%s/%s' % (n.name, node.op_type)
        node.name = graph.node_name(base)


def _value_info(name, shape, batched, batch_size):
    """Float tensor info; a batched first axis is 'batch' (or unnamed when a multiple)."""
    dims = list(shape)
    if batched:
        dims[0] = 'batch' if shape[0] == batch_size else None
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)


def _model(net, graph, tensors, batched, output_blobs):
    batch_size = net.blobs[net.inputs[0]].shape[0] if net.inputs else None

    def info(tensor, blob):
        return _value_info(tensor, net.blobs[blob].shape, batched.get(blob, False), batch_size)

    inputs = [info(name, name) for name in net.inputs]
    outputs = []
    for name in output_blobs:
        tensor = tensors[name]
        if tensor != name:              # an alias of another tensor: name it
            final = graph.claim(name)
            graph.nodes.append(helper.make_node('Identity', [tensor], [final],
                                                name=graph.node_name(name + '/output')))
            tensor = final
        outputs.append(info(tensor, name))
    model = graph.model
    model.graph.name = net.name or 'caffe_net'
    model.graph.node.extend(graph.nodes)
    model.graph.input.extend(inputs)
    model.graph.output.extend(outputs)
    model.opset_import.add(domain='', version=graph.opset)
    model.ir_version = helper.find_min_ir_version_for(list(model.opset_import))
    model.producer_name = 'caffe_syncbn'
    model.doc_string = 'Caffe net %r exported by caffe_syncbn' % (net.name,)
    return model


def exportable_types():
    """The Caffe layer types that have an ONNX rule (the package imports every rule module)."""
    return ruled_types()
