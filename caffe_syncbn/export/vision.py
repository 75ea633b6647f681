"""Rules for the spatial layers: Pooling, SPP, LRN and the PSPNet fork's Interp.

Caffe's pooled size is its own (ceil rounding, minus a last window that would start in
the padding), so every pooling here states its end padding explicitly and lets ONNX round
down: the end pad makes exactly the windows Caffe has. AVE divides by the window clipped
to [-pad, size + pad): padded cells count, the ceil overhang past them does not. That is a
zero Pad of ``pad`` on each side (cells that count) and then an AveragePool whose extra end
padding is excluded from the divisor (count_include_pad=0).
"""
from onnx import TensorProto

from .graph import Unsupported, rule


def _overhang(size, kernel, stride, pad, out):
    """How far the last window reaches past size + 2*pad (0 if it does not)."""
    return max(0, (out - 1) * stride + kernel - (size + 2 * pad))


def _pool(n, x, pool, with_mask=False):
    """One Caffe 2-D pooling (a layers.pooling.array.Pool2d) of tensor x; (top, mask or None)."""
    kernel, stride, pad = list(pool.kernel), list(pool.stride), list(pool.pad)
    ends = [_overhang(*geometry) for geometry in
            zip(pool.in_hw, kernel, stride, pad, pool.out_hw)]
    # a MAX window wholly in the padding, or any window past it, has no ONNX equivalent
    reach = [e + p if pool.method == 'MAX' else e for p, e in zip(pad, ends)]
    if any(r >= k for r, k in zip(reach, kernel)):
        raise Unsupported('its last %s window lies outside the input %s (kernel %s, stride %s, '
                          'pad %s)' % (pool.method, pool.in_hw, kernel, stride, pad))
    if pool.method == 'MAX':
        outputs = 2 if with_mask else 1
        result = n.op('MaxPool', x, outputs=outputs, kernel_shape=kernel, strides=stride,
                      pads=pad + [p + e for p, e in zip(pad, ends)])
        if not with_mask:
            return result, None
        top, index = result
        # ONNX indexes the whole (N, C, H, W) tensor, Caffe the plane: h * W + w
        plane = n.ints(pool.in_hw[0] * pool.in_hw[1], 'plane')
        return top, n.op('Cast', n.op('Mod', index, plane), to=TensorProto.FLOAT)
    if any(pad):
        x = n.op('Pad', x, n.ints([0, 0] + pad + [0, 0] + pad, 'pads'))

    def average(t):
        return n.op('AveragePool', t, kernel_shape=kernel, strides=stride,
                    pads=[0, 0] + ends, count_include_pad=0)

    if pool.method == 'AVE':
        return average(x), None
    # STOCHASTIC in TEST: sum(x^2) / sum(x) over each window, 0 where sum(x) <= 0
    total = average(x)
    positive = n.op('Greater', total, n.const(0, 'zero'))
    safe = n.op('Where', positive, total, n.const(1, 'one'))
    ratio = n.op('Div', average(n.op('Mul', x, x)), safe)
    return n.op('Where', positive, ratio, n.const(0, 'zero')), None


@rule('Pooling')
def pooling(n):
    pool = n.layer.pool
    with_mask = len(n.param.top) > 1
    if n.param.pooling_param.global_pooling and not with_mask and pool.method != 'STOCHASTIC':
        return [n.op('GlobalMaxPool' if pool.method == 'MAX' else 'GlobalAveragePool',
                     n.inputs[0])]
    top, mask = _pool(n, n.inputs[0], pool, with_mask)
    return [top, mask] if with_mask else [top]


@rule('SPP')
def spp(n):
    levels = n.layer.levels
    if len(levels) == 1:                    # Caffe gives that pooling's 4-D top itself
        return [_pool(n, n.inputs[0], levels[0])[0]]
    flat = [n.op('Flatten', _pool(n, n.inputs[0], p)[0], axis=1) for p in levels]
    return [n.op('Concat', *flat, axis=1)]


@rule('LRN')
def lrn(n):
    layer, x = n.layer, n.inputs[0]
    if layer.across:
        return [n.op('LRN', x, size=layer.size, alpha=layer.alpha, beta=layer.beta,
                     bias=layer.k)]
    # WITHIN_CHANNEL: x / (1 + alpha * mean of x^2 over a zero-padded size x size window)^beta
    half = (layer.size - 1) // 2
    mean = n.op('AveragePool', n.op('Mul', x, x), kernel_shape=[layer.size] * 2,
                pads=[half] * 4, count_include_pad=1)
    scale = n.op('Add', n.op('Mul', mean, n.const(layer.alpha, 'alpha')), n.const(1, 'one'))
    return [n.op('Mul', x, n.op('Pow', scale, n.const(-layer.beta, 'minus_beta')))]


@rule('Interp')
def interp(n):
    layer, x = n.layer, n.inputs[0]
    begin = layer.crop_begin
    height, width = layer.in_hw
    if n.in_shapes[0][2:] != (height, width):      # pad_beg/pad_end < 0 crop first
        x = n.slice(x, [begin, begin], [begin + height, begin + width], [2, 3])
    if layer.copy_only:
        return [x]
    return [n.op('Resize', x, '', '', n.sizes_like(x, layer.out_hw), mode='linear',
                 coordinate_transformation_mode='align_corners')]
