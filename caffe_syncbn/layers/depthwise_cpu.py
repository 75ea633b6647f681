"""Depthwise convolution on the host: group == channels == outputs, 2-D.

Each output plane is its input plane convolved with one small kernel, so the work is
KH x KW shifted multiply-adds over the planes, where the GEMM path makes an im2col copy
and one tiny GEMM per channel. The passes walk blocks of (image, channel) planes a few
hundred KB at a time, split over cpu_threads; the weight gradient is summed per block and
the blocks' sums added in block order, so the result does not depend on the threads.
"""
import math
import numpy as np

from ..backend import cpu_threads


def applies(layer):
    """Whether this module runs ``layer`` (a Convolution set up with its geometry)."""
    return (not layer.transposed and layer.num_spatial == 2 and layer.group > 1
            and layer.group == layer.channels == layer.num_output)


def _padded(layer, x4):
    (ph, pw) = layer.pad
    if not ph and not pw:
        return x4
    return np.pad(x4, ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def _taps(layer):
    """(i, j, row slice, column slice) of each kernel tap in the padded plane."""
    (kh, kw), (sh, sw), (dh, dw) = layer.kernel, layer.stride, layer.dilation
    oh, ow = layer.out_spatial
    return [(i, j, slice(i * dh, i * dh + sh * (oh - 1) + 1, sh),
             slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)) for i in range(kh) for j in range(kw)]


def _planes(array4):
    return array4.reshape((-1,) + array4.shape[2:])


def _run(layer, padded, work):
    """``work(r0, r1, channels)`` over blocks of the planes of ``padded`` (N*C, H, W), with
    the channel of each plane."""
    def block(r0, r1):
        work(r0, r1, np.arange(r0, r1) % layer.channels)
    cpu_threads.blocks(np, padded.shape[0], int(math.prod(padded.shape[1:])), block,
                       padded.dtype.itemsize)


def forward(layer, x4, y3):
    """``y3`` (N, C, OH*OW) = the depthwise convolution of ``x4`` (N, C, H, W), bias added."""
    padded = _planes(_padded(layer, x4))
    out = y3.reshape((-1,) + tuple(layer.out_spatial))
    weight = layer.blobs[0].data.reshape(layer.channels, -1)
    bias = layer.blobs[1].data if layer.bias_term else None
    taps = _taps(layer)

    def work(r0, r1, channels):
        target = out[r0:r1]
        target[...] = 0 if bias is None else bias[channels, None, None]
        for k, (_, _, rows, cols) in enumerate(taps):
            target += padded[r0:r1, rows, cols] * weight[channels, k, None, None]
    _run(layer, padded, work)


def backward(layer, x4, dy3, dx4, weight_grad):
    """Accumulate the weight gradient into ``weight_grad`` (C, 1, KH*KW, or None) and
    write ``dx4`` (N, C, H, W, or None) from ``dy3`` (N, C, OH*OW)."""
    padded = _planes(_padded(layer, x4))
    dy = dy3.reshape((-1,) + tuple(layer.out_spatial))
    weight = layer.blobs[0].data.reshape(layer.channels, -1)
    taps = _taps(layer)
    dpadded = np.zeros_like(padded) if dx4 is not None else None
    partial = {}

    def work(r0, r1, channels):
        if weight_grad is not None:
            sums = np.empty((len(taps), layer.channels), weight.dtype)
            for k, (_, _, rows, cols) in enumerate(taps):
                per_plane = np.einsum('pij,pij->p', dy[r0:r1], padded[r0:r1, rows, cols])
                sums[k] = np.bincount(channels, per_plane, minlength=layer.channels)
            partial[r0] = sums
        if dpadded is not None:
            for k, (_, _, rows, cols) in enumerate(taps):
                dpadded[r0:r1, rows, cols] += dy[r0:r1] * weight[channels, k, None, None]
    _run(layer, padded, work)
    if weight_grad is not None:
        total = sum(partial[r0] for r0 in sorted(partial))
        weight_grad += total.T.reshape(weight_grad.shape).astype(weight_grad.dtype)
    if dx4 is not None:
        (ph, pw), (h, w) = layer.pad, x4.shape[2:]
        dx4[...] = dpadded.reshape(dx4.shape[:2] + dpadded.shape[1:])[:, :, ph:ph + h,
                                                                       pw:pw + w]
