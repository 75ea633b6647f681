"""Rules for the learned linear layers: Convolution, Deconvolution, InnerProduct, Embed."""
from onnx import TensorProto

from .graph import Unsupported, rule


def _convolution(n, op_type):
    layer = n.layer
    if layer.axis != 1:
        raise Unsupported('channel axis %d (ONNX convolves (N, C, spatial...) only)' % layer.axis)
    inputs = [n.weight(0, what='weight')]
    if layer.bias_term:
        inputs.append(n.weight(1, what='bias'))
    attrs = dict(kernel_shape=list(layer.kernel), strides=list(layer.stride),
                 pads=list(layer.pad) * 2, dilations=list(layer.dilation), group=layer.group)
    # several bottom/top pairs share the weights
    return [n.op(op_type, x, *inputs, **attrs) for x in n.inputs]


@rule('Convolution')
def convolution(n):
    return _convolution(n, 'Conv')


@rule('Deconvolution')
def deconvolution(n):
    # Caffe's weights are (C_in, C_out / group, *kernel), ConvTranspose's layout; its output
    # size stride*(in-1) + dilation*(k-1) + 1 - 2*pad is ConvTranspose's with these pads.
    return _convolution(n, 'ConvTranspose')


@rule('InnerProduct')
def inner_product(n):
    layer = n.layer
    rows = n.op('Flatten', n.inputs[0], axis=layer.axis)       # (outer, inputs)
    inputs = [rows, n.weight(0, what='weight')]
    if layer.bias_term:
        inputs.append(n.weight(1, what='bias'))
    # the weights are (outputs, inputs), or (inputs, outputs) with transpose
    y = n.op('Gemm', *inputs, transB=0 if layer.transpose else 1)
    if len(n.out_shapes[0]) == 2:
        return [y]
    return [n.reshape(y, n.out_shapes[0])]


@rule('Embed')
def embed(n):
    index = n.op('Cast', n.inputs[0], to=TensorProto.INT64)
    y = n.op('Gather', n.weight(0, what='table'), index, axis=0)
    if n.layer.bias_term:
        y = n.op('Add', y, n.weight(1, what='bias'))
    return [y]
