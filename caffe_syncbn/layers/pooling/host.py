"""Pooling's host engine (numpy), with the array engine's signatures (array.py): MAX pooling
of small kernels as one strided view per kernel offset, a block of channel planes at a
time, split over cpu_threads; the other methods and larger kernels run on the array engine.

The forward keeps, per output, the offset of its maximum in the window (one byte for
kernels of up to 127 cells), not a flat index: the first maximum in row-major order wins,
as in Caffe, because an offset replaces the kept one only where its value is strictly
larger. Index updates are arithmetic (idx += better * (k - idx)): masked writes with
random masks run many times slower.
"""
import numpy as np

from ...backend import cpu_threads
from . import array

#: kernels of more cells than this go to the separable code of the array engine
MAX_CELLS = 64


def applies(pool):
    kh, kw = pool.kernel
    return pool.method == 'MAX' and kh * kw <= MAX_CELLS


def _offsets(pool):
    kh, kw = pool.kernel
    return [(k, k // kw, k % kw) for k in range(kh * kw)]


def _view(padded, pool, i, j):
    """The cells that kernel offset (i, j) reads, one per output."""
    (sh, sw), (oh, ow) = pool.stride, pool.out_hw
    return padded[:, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]


def _padded(pool, planes):
    """``planes`` (P, H, W) within the padded extent that covers every window, -inf
    outside the input."""
    if pool.padded_hw == pool.in_hw:
        return planes
    (ph, pw), (h, w) = pool.pad, pool.in_hw
    out = np.full((planes.shape[0],) + pool.padded_hw, -np.inf, planes.dtype)
    out[:, ph:ph + h, pw:pw + w] = planes
    return out


def _planes(array):
    return array.reshape((-1,) + array.shape[2:])


def forward(pool, x, phase, rng, out):
    pool.offsets = None
    if not applies(pool):
        array.forward(pool, x, phase, rng, out)
        return
    pool.offsets = _max_forward(pool, x, out)


def mask(pool):
    if pool.offsets is None:
        return array.mask(pool)
    return flat_index(pool, pool.offsets)


def backward(pool, dy, phase, out):
    if pool.offsets is None:
        array.backward(pool, dy, phase, out)
    else:
        _max_backward(pool, pool.offsets, dy, out)


def _max_forward(pool, x, top):
    """MAX pooling of ``x`` (N, C, H, W) into ``top``; returns the offsets of the maxima."""
    n, c = x.shape[:2]
    offsets = np.empty((n, c) + pool.out_hw, np.int8)
    source, y, kept = _planes(x), _planes(top), _planes(offsets)

    def work(r0, r1):
        padded = _padded(pool, source[r0:r1])
        best, where = y[r0:r1], kept[r0:r1]
        for k, i, j in _offsets(pool):
            v = _view(padded, pool, i, j)
            if k == 0:
                best[...] = v
                where[...] = 0
                continue
            better = v > best
            np.maximum(best, v, out=best)
            step = np.subtract(k, where, dtype=np.int8)
            step *= better
            where += step
    cpu_threads.blocks(np, n * c, x.shape[2] * x.shape[3], work, x.dtype.itemsize)
    return offsets


def _tiles(pool):
    """Whether the windows tile the input: every cell lies in exactly one window."""
    return (pool.stride == pool.kernel and not any(pool.pad)
            and all(o * k == s for o, k, s in zip(pool.out_hw, pool.kernel, pool.in_hw)))


def _max_backward(pool, offsets, dy, dx):
    """dx (N, C, H, W) of MAX pooling from the kept offsets and the top diff ``dy``. Where
    the windows tile the input, each offset's cells are written once; elsewhere the
    gradients are added at the maxima's flat indices (np.add.at sums repeats)."""
    n, c = dy.shape[:2]
    target, grad, kept = _planes(dx), _planes(dy), _planes(offsets)
    tiles = _tiles(pool)
    plane = pool.in_hw[0] * pool.in_hw[1]

    def work(r0, r1):
        g, where = grad[r0:r1], kept[r0:r1]
        if tiles:
            for k, i, j in _offsets(pool):
                np.multiply(g, where == k, out=_view(target[r0:r1], pool, i, j))
            return
        block = target[r0:r1].reshape(-1)
        block[...] = 0
        index = flat_index(pool, where) + (np.arange(r1 - r0) * plane).reshape(-1, 1, 1)
        np.add.at(block, index.ravel(), g.ravel())
    cpu_threads.blocks(np, n * c, plane, work, dy.dtype.itemsize)


def flat_index(pool, offsets):
    """Caffe's MAX mask: the index h * W + w in the input of each maximum: where its
    window starts, plus where in the window it lies."""
    (sh, sw), (ph, pw), (oh, ow), (kh, kw) = pool.stride, pool.pad, pool.out_hw, pool.kernel
    width = pool.in_hw[1]
    starts = (np.arange(-ph, oh * sh - ph, sh).reshape(-1, 1) * width
              + np.arange(-pw, ow * sw - pw, sw))
    within = (np.arange(kh).reshape(-1, 1) * width + np.arange(kw)).ravel()
    return starts + np.take(within, offsets)
