"""Depthwise convolution and deconvolution on the host: group == channels == outputs, 2-D.

Each output plane of a depthwise convolution is its input plane correlated with one small
kernel, so the work is KH x KW shifted multiply-adds over the planes (a gather), where the
GEMM path makes an im2col copy and one tiny GEMM per channel. Its data gradient adds the
same shifted planes back (a scatter). A Deconvolution is the adjoint: its forward is the
scatter and its data gradient the gather. Both slide the kernel over a "wide" plane
(a Convolution's input, a Deconvolution's output), padded, and put its positions on a
"narrow" one (the other side); the weight gradient pairs the two in either case.

The passes walk blocks of (image, channel) planes a few hundred KB at a time, split over
cpu_threads. The blocks follow from the shape alone, the weight gradient is summed per
block and the blocks' sums added in block order, so the result does not depend on the
threads.
"""
import numpy as np

from ..backend import cpu_threads


def applies(layer):
    """Whether this module runs ``layer`` (a Convolution or Deconvolution set up with its
    geometry); ``engine: CAFFE`` keeps it on im2col."""
    cp = layer.param.convolution_param
    return (layer.num_spatial == 2 and layer.group > 1 and cp.engine != cp.CAFFE
            and layer.group == layer.channels == layer.num_output)


def _sides(layer):
    """The spatial shapes of the (wide, narrow) planes, the wide one unpadded."""
    if layer.transposed:
        return tuple(layer.out_spatial), tuple(layer.in_spatial)
    return tuple(layer.in_spatial), tuple(layer.out_spatial)


def _padded_shape(layer):
    (h, w), (ph, pw) = _sides(layer)[0], layer.pad
    return h + 2 * ph, w + 2 * pw


def _taps(layer):
    """(row slice, column slice) of each kernel tap in the padded wide plane."""
    (kh, kw), (sh, sw), (dh, dw) = layer.kernel, layer.stride, layer.dilation
    oh, ow = _sides(layer)[1]
    return [(slice(i * dh, i * dh + sh * (oh - 1) + 1, sh),
             slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)) for i in range(kh) for j in range(kw)]


def _planes(array, spatial):
    return array.reshape((-1,) + spatial)


def _padded(layer, planes):
    """``planes`` (wide) with the zero padding around them: themselves where there is none,
    else a copy in this thread's scratch."""
    (ph, pw), (h, w) = layer.pad, planes.shape[1:]
    if not ph and not pw:
        return planes
    padded = cpu_threads.scratch_array('depthwise padded', (len(planes),) + _padded_shape(layer),
                                       planes.dtype)
    padded[:, :ph] = 0
    padded[:, ph + h:] = 0
    padded[:, ph:ph + h, :pw] = 0
    padded[:, ph:ph + h, pw + w:] = 0
    padded[:, ph:ph + h, pw:pw + w] = planes
    return padded


def _gather(taps, padded, weight, channels, target):
    """``target`` (narrow planes) += each tap's window of ``padded`` times its weight."""
    for k, (rows, cols) in enumerate(taps):
        target += padded[:, rows, cols] * weight[channels, k, None, None]


def _scatter(layer, taps, source, weight, channels, target):
    """``target`` (wide planes) = ``source`` (narrow planes) times each tap's weight, added
    at the tap's window, the padding cut off."""
    (ph, pw), (h, w) = layer.pad, target.shape[1:]
    padded = target if not ph and not pw else cpu_threads.scratch_array(
        'depthwise scattered', (len(target),) + _padded_shape(layer), target.dtype)
    padded[...] = 0
    product = cpu_threads.scratch_array('depthwise product', source.shape, source.dtype)
    for k, (rows, cols) in enumerate(taps):
        np.multiply(source, weight[channels, k, None, None], out=product)
        padded[:, rows, cols] += product
    if padded is not target:
        target[...] = padded[:, ph:ph + h, pw:pw + w]


def _tap_sums(taps, padded, narrow, channels, count):
    """(taps, channels): for each tap and channel, the sum over that channel's planes of
    ``narrow`` times the tap's window of ``padded``."""
    sums = np.empty((len(taps), count), padded.dtype)
    for k, (rows, cols) in enumerate(taps):
        per_plane = np.einsum('pij,pij->p', narrow, padded[:, rows, cols])
        sums[k] = np.bincount(channels, per_plane, minlength=count)
    return sums


def _run(layer, planes, dtype, work):
    """``work(r0, r1, channels)`` over blocks of ``planes`` (image, channel) planes, with
    the channel of each plane; a block holds about BLOCK_BYTES of padded wide planes."""
    plane = int(np.prod(_padded_shape(layer)))
    per_block = max(1, cpu_threads.BLOCK_BYTES // (plane * np.dtype(dtype).itemsize))

    def part(first, stop):
        for b in range(first, stop):
            r0, r1 = b * per_block, min(planes, (b + 1) * per_block)
            work(r0, r1, np.arange(r0, r1) % layer.channels)
    cpu_threads.split(-(-planes // per_block), part,
                      max(1, cpu_threads.PARALLEL_MIN_ELEMENTS // (per_block * plane)))


def _weight(layer):
    return layer.blobs[0].data.reshape(layer.channels, -1)


def forward(layer, x4, y3):
    """``y3`` (N, C, OH*OW) = the depthwise (de)convolution of ``x4`` (N, C, H, W), bias
    added."""
    x, y = _planes(x4, tuple(layer.in_spatial)), _planes(y3, tuple(layer.out_spatial))
    weight, taps = _weight(layer), _taps(layer)
    bias = layer.blobs[1].data if layer.bias_term else None

    def work(r0, r1, channels):
        if layer.transposed:
            _scatter(layer, taps, x[r0:r1], weight, channels, y[r0:r1])
            if bias is not None:
                y[r0:r1] += bias[channels, None, None]
            return
        y[r0:r1] = 0 if bias is None else bias[channels, None, None]
        _gather(taps, _padded(layer, x[r0:r1]), weight, channels, y[r0:r1])
    _run(layer, len(x), x.dtype, work)


def backward(layer, x4, dy3, dx4, weight_grad):
    """Accumulate the weight gradient into ``weight_grad`` (C, 1, KH*KW, or None) and
    write ``dx4`` (N, C, H, W, or None) from ``dy3`` (N, C, OH*OW)."""
    x, dy = _planes(x4, tuple(layer.in_spatial)), _planes(dy3, tuple(layer.out_spatial))
    dx = None if dx4 is None else _planes(dx4, tuple(layer.in_spatial))
    weight, taps = _weight(layer), _taps(layer)
    partial = {}

    def work(r0, r1, channels):
        if layer.transposed:            # dy is the wide side: padded once for both
            padded, narrow = _padded(layer, dy[r0:r1]), x[r0:r1]
            if dx is not None:
                dx[r0:r1] = 0
                _gather(taps, padded, weight, channels, dx[r0:r1])
        else:
            narrow = dy[r0:r1]
            if dx is not None:
                _scatter(layer, taps, narrow, weight, channels, dx[r0:r1])
            padded = _padded(layer, x[r0:r1]) if weight_grad is not None else None
        if weight_grad is not None:
            partial[r0] = _tap_sums(taps, padded, narrow, channels, layer.channels)
    _run(layer, len(x), x.dtype, work)
    if weight_grad is not None and partial:
        total = sum(partial[r0] for r0 in sorted(partial))
        weight_grad += total.T.reshape(weight_grad.shape).astype(weight_grad.dtype)
