"""Rules for the element-wise layers, Dropout and Softmax."""
from onnx import TensorProto

from .graph import rule


def _single(op_type):
    def export(n):
        return [n.op(op_type, n.inputs[0])]
    return export


rule('Sigmoid')(_single('Sigmoid'))
rule('TanH')(_single('Tanh'))
rule('AbsVal')(_single('Abs'))
rule('BNLL')(_single('Softplus'))


@rule('ReLU')
def relu(n):
    slope = n.param.relu_param.negative_slope
    if slope == 0:
        return [n.op('Relu', n.inputs[0])]
    return [n.op('LeakyRelu', n.inputs[0], alpha=slope)]


@rule('PReLU')
def prelu(n):
    # per-channel slopes broadcast from axis 1: (C, 1, ..., 1)
    ndim = len(n.in_shapes[0])
    shape = (1,) if n.layer.channel_shared else (-1,) + (1,) * (ndim - 2)
    return [n.op('PRelu', n.inputs[0], n.weight(0, shape, 'slope'))]


@rule('ELU')
def elu(n):
    return [n.op('Elu', n.inputs[0], alpha=n.param.elu_param.alpha)]


def _affine(n, x, scale, shift):
    if scale != 1:
        x = n.op('Mul', x, n.const(scale, 'scale'))
    if shift != 0:
        x = n.op('Add', x, n.const(shift, 'shift'))
    return x


@rule('Power')
def power(n):
    p = n.param.power_param
    x = n.inputs[0]
    if p.scale == 0 or p.power == 0:        # a constant of the input's shape
        value = 1.0 if p.power == 0 else p.shift ** p.power
        return [n.op('Expand', n.const(value, 'value'), n.op('Shape', x))]
    base = _affine(n, x, p.scale, p.shift)
    if p.power == 1:
        return [base]
    return [n.op('Pow', base, n.const(p.power, 'power'))]


@rule('Exp')
def exp(n):
    layer = n.layer          # y = outer * exp(inner * x), as the layer computes it
    y = n.op('Exp', _affine(n, n.inputs[0], layer.inner_scale, 0))
    return [_affine(n, y, layer.outer_scale, 0)]


@rule('Log')
def log(n):
    p = n.param.log_param
    y = n.op('Log', _affine(n, n.inputs[0], p.scale, p.shift))
    return [_affine(n, y, n.layer.inv_log_base, 0)]


@rule('Swish')
def swish(n):
    x = n.inputs[0]
    return [n.op('Mul', x, n.op('Sigmoid', _affine(n, x, n.param.swish_param.beta, 0)))]


@rule('Clip')
def clip(n):
    p = n.param.clip_param
    return [n.op('Clip', n.inputs[0], n.const(p.min, 'min'), n.const(p.max, 'max'))]


@rule('ReLU6')
def relu6(n):
    x = n.inputs[0]
    y = n.op('Clip', x, n.const(0.0, 'min'), n.const(6.0, 'max'))
    if n.layer.slope == 0:
        return [y]
    negative = n.op('Min', x, n.const(0.0, 'zero'))
    return [n.op('Add', y, _affine(n, negative, n.layer.slope, 0))]


@rule('Threshold')
def threshold(n):
    above = n.op('Greater', n.inputs[0], n.const(n.param.threshold_param.threshold, 'threshold'))
    return [n.op('Cast', above, to=TensorProto.FLOAT)]


@rule('Dropout')
def dropout(n):
    # TEST phase: the identity, or a multiplication by 1 - ratio without scale_train
    if n.layer.scale_train:
        return [n.inputs[0]]
    return [_affine(n, n.inputs[0], 1.0 / n.layer.scale, 0)]


@rule('Softmax')
def softmax(n):
    return [n.op('Softmax', n.inputs[0], axis=n.layer.axis)]

