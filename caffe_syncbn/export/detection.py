"""Rules for the SSD fork's layers: a detection net exports up to its raw heads (box
offsets, class scores, and the priors as a constant); the box decoding and the
suppression of DetectionOutput stay outside the model."""
import numpy as np

from ..backend import to_numpy
from .graph import Unsupported, rule


@rule('Permute')
def permute(n):
    if n.layer.identity:
        return [n.inputs[0]]
    if n.batched and n.layer.order[0] != 0:
        raise Unsupported('moving the batch axis cannot have a symbolic batch')
    return [n.op('Transpose', n.inputs[0], perm=list(n.layer.order))]


@rule('Normalize')
def normalize(n):
    layer, x = n.layer, n.inputs[0]
    num_axes = len(n.in_shapes[0])
    axes = list(range(1, num_axes)) if layer.across_spatial else [1]
    squares = n.reduce('ReduceSum', n.op('Mul', x, x), axes)
    norm = n.op('Sqrt', n.op('Add', squares, n.const(layer.eps, 'eps')))
    scale_shape = [] if layer.channel_shared else [1, -1] + [1] * (num_axes - 2)
    scale = n.const(to_numpy(layer.blobs[0].data).reshape(scale_shape), 'scale')
    return [n.op('Mul', n.op('Div', x, norm), scale)]


@rule('PriorBox')
def prior_box(n):
    # the boxes depend only on the bottoms' shapes, which the export fixes
    return [n.const(np.asarray(n.layer.prior_boxes(), np.float32), 'priors')]


@rule('DetectionOutput')
def detection_output(n):
    raise Unsupported("ONNX has no operator with the SSD fork's decoding and suppression "
                      '(per-class NMS with eta, keep_top_k over classes); export up to its '
                      'bottoms, to decode outside the model: --outputs %s'
                      % ','.join(n.param.bottom[:3]))
