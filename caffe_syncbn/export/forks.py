"""Rules for the layers of other forks (docs/fork-layers.md) that ONNX expresses exactly:
the depthwise convolutions, ShuffleChannel, Axpy and nearest-neighbour Upsample."""
from .conv import convolution
from .graph import Unsupported, rule

# their layers are Convolution layers with group = channels
rule('ConvolutionDepthwise', 'DepthwiseConvolution')(convolution)


@rule('ShuffleChannel')
def shuffle_channel(n):
    shape = n.in_shapes[0]
    group = n.layer.group
    rest = 1
    for size in shape[2:]:
        rest *= size
    grid = n.reshape(n.inputs[0], (shape[0], group, shape[1] // group, rest))
    shuffled = n.op('Transpose', grid, perm=[0, 2, 1, 3])
    return [n.reshape(shuffled, shape)]


@rule('Axpy')
def axpy(n):
    a, x, y = n.inputs
    x_shape = n.in_shapes[1]
    scale = n.reshape(a, tuple(x_shape[:2]) + (1,) * (len(x_shape) - 2))
    return [n.op('Add', n.op('Mul', scale, x), y)]


@rule('Upsample')
def upsample(n):
    layer = n.layer
    if layer.unpooling:
        raise Unsupported("SegNet's unpooling by a pooling mask has no exact ONNX form "
                          '(MaxUnpool leaves repeated indices undefined)')
    scales = n.const([1.0, 1.0] + [float(s) for s in layer.scale], 'scales')
    return [n.op('Resize', n.inputs[0], '', scales, mode='nearest',
                 coordinate_transformation_mode='asymmetric', nearest_mode='floor')]
