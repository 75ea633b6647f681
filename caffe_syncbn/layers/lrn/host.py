"""LRN across channels on the host (numpy): bands of one image's positions, about BAND_BYTES
each, split over cpu_threads, with the array engine's signatures (array.py). Across
channels, positions are independent, and the window runs along the channels of each band.
"""
import math
import numpy as np

from ...backend import cpu_threads
from .array import centered_window_sum

#: a band holds this many bytes of one image's positions
BAND_BYTES = 4 << 20


def _bands(shape, work):
    """``work(n, band)`` over images and bands of positions of (N, C, H*W) arrays, split
    over threads. (Narrower bands, strided in memory, ran slower than whole images.)"""
    n, c = shape[:2]
    positions = int(math.prod(shape[2:]))
    width = max(1, BAND_BYTES // (4 * max(c, 1)))      # 0 channels: empty bands
    bands = [(i, slice(p, min(positions, p + width)))
             for i in range(n) for p in range(0, positions, width)]

    def part(a, b):
        for i, band in bands[a:b]:
            work(i, band)
    cpu_threads.split(len(bands), part)


def _as_3d(a):
    """(N, C, H*W) of an (N, C, H, W) array, also where an axis has size 0."""
    return a.reshape(a.shape[0], a.shape[1], a.shape[2] * a.shape[3])


def forward(layer, bottom, top):
    x, y = bottom[0].data, top[0].data
    x3, y3 = _as_3d(x), _as_3d(y)
    if layer.scale is None or layer.scale.shape != x3.shape or layer.scale.dtype != x.dtype:
        layer.scale = np.empty_like(x3)          # kept from one forward to the next
    scale = layer.scale

    def work(i, band):
        s = scale[i, :, band]
        xs = x3[i, :, band]
        np.multiply(xs, xs, out=s)
        s[...] = centered_window_sum(s, 0, layer.size)
        s *= layer.alpha / layer.cells
        s += layer.k
        np.multiply(xs, s ** -layer.beta, out=y3[i, :, band])
    _bands(x.shape, work)


def backward(layer, top, propagate_down, bottom):
    if not propagate_down[0]:
        return
    x3, y3, dy3, dx3 = (_as_3d(a) for a in (bottom[0].data, top[0].data, top[0].diff,
                                            bottom[0].diff))
    factor = 2 * layer.alpha * layer.beta / layer.cells

    def work(i, band):
        s, g = layer.scale[i, :, band], dy3[i, :, band]
        through = g * y3[i, :, band]
        through /= s
        through = centered_window_sum(through, 0, layer.size)
        through *= x3[i, :, band]
        through *= factor
        # dy is read before dx is written (in place they are one array)
        np.multiply(g, s ** -layer.beta, out=dx3[i, :, band])
        dx3[i, :, band] -= through
    _bands(bottom[0].shape, work)
