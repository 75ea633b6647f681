"""Pooling's array engine, which runs on numpy and CuPy alike: Pool2d, one 2-D pooling of a
fixed geometry, and the engine's three functions over it, whose signatures the host
(host.py) and CUDA (gpu.py) engines share: ``forward(pool, x, phase, rng, out)``,
``mask(pool)`` (MAX's top mask) and ``backward(pool, dy, phase, out)``.

Window reductions are separable: a strided slice per kernel column reduces along W,
then a strided slice per kernel row along H, so no (windows x kernel) array is built.
MAX keeps the position of each maximum (the first in row-major order, as Caffe does),
and its backward scatters through those positions.
"""
import numpy as np

from ...backend import get_array_module
from ...layer import TRAIN


def pooled_size(size, kernel, stride, pad, ceil_mode=True):
    """Caffe's pooled size; with padding the last window may not start inside the padding."""
    span = size + 2 * pad - kernel
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if pad and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _strided(a, axis, start, stride, count):
    """``count`` cells of ``a`` along ``axis`` from ``start`` every ``stride``."""
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, start + stride * (count - 1) + 1, stride)
    return a[tuple(index)]


def _window_max(a, axis, kernel, stride, count):
    """Max over windows along one axis, and the offset in the window of its first maximum."""
    xp = get_array_module(a)
    parts = [_strided(a, axis, j, stride, count) for j in range(kernel)]
    best = parts[0]
    for part in parts[1:]:
        best = xp.maximum(best, part)
    # the offset of the first part equal to the max = how many parts before it differ
    offset = xp.zeros(best.shape, np.int16)
    still_looking = None
    for part in parts[:-1]:
        differs = part != best
        still_looking = differs if still_looking is None else still_looking & differs
        offset += still_looking
    return best, offset


def _window_sum(a, axis, kernel, stride, count):
    total = _strided(a, axis, 0, stride, count).copy()
    for j in range(1, kernel):
        total += _strided(a, axis, j, stride, count)
    return total


def _spread(g, axis, kernel, stride, size):
    """Adjoint of ``_window_sum``: each window's value added to every cell it covers."""
    xp = get_array_module(g)
    shape = list(g.shape)
    shape[axis] = size
    out = xp.zeros(shape, g.dtype)
    for j in range(kernel):
        _strided(out, axis, j, stride, g.shape[axis])[...] += g
    return out


def scatter_add(target, index, values):
    """``target[index] += values`` where ``index`` (1-D) may repeat (CuPy has ufunc.at
    since version 12)."""
    get_array_module(target).add.at(target, index, values)


class Pool2d:
    """One 2-D pooling of a fixed geometry over (N, C, H, W) arrays, forward and backward."""

    def __init__(self, method, in_hw, kernel, stride, pad, ceil_mode, error):
        self.method = method
        self.in_hw, self.kernel, self.stride, self.pad = in_hw, kernel, stride, pad
        if min(kernel) < 1 or min(stride) < 1:
            raise error('kernel %s and stride %s must be positive' % (kernel, stride))
        if any(p >= k for p, k in zip(pad, kernel)):
            raise error('pad %s must be smaller than the kernel %s' % (pad, kernel))
        if any(pad) and method not in ('MAX', 'AVE'):
            raise error('padding works with MAX and AVE pooling only, not %s' % method)
        self.out_hw = tuple(pooled_size(*args, ceil_mode=ceil_mode)
                            for args in zip(in_hw, kernel, stride, pad))
        if min(self.out_hw) < 1:
            raise error('kernel %s with pad %s does not fit the input %s'
                        % (kernel, pad, in_hw))
        # the padded extent covering every window: [-pad, last window end)
        self.padded_hw = tuple(p + max(size, (o - 1) * s + k - p) for size, k, s, p, o in
                               zip(in_hw, kernel, stride, pad, self.out_hw))
        self.overlapping = any(s < k for s, k in zip(stride, kernel))
        #: one window that is the whole input (global pooling)
        self.whole = self.out_hw == (1, 1) and tuple(kernel) == tuple(in_hw) and not any(pad)
        #: MAX and STOCHASTIC: the index h * W + w of each output's cell, from the forward
        self.index = None
        #: MAX on the host engine: the offset of each maximum in its window (host.py)
        self.offsets = None
        self._divisor = None

    def _padded(self, x, fill):
        xp = get_array_module(x)
        if self.padded_hw == self.in_hw:
            return x
        (ph, pw), (h, w) = self.pad, self.in_hw
        out = xp.full(x.shape[:2] + self.padded_hw, fill, x.dtype)
        out[:, :, ph:ph + h, pw:pw + w] = x
        return out

    def _window_sums(self, x):
        (kh, kw), (sh, sw), (oh, ow) = self.kernel, self.stride, self.out_hw
        rows = _window_sum(self._padded(x, 0), 3, kw, sw, ow)
        return _window_sum(rows, 2, kh, sh, oh)

    def _whole_sums(self, x):
        """``_window_sums`` of one window over the whole input in a few calls, in the same
        order: along W, then along H, each a running sum. (A reduction over an array's
        first axis adds its rows one after the other; over its last axis, numpy adds
        pairwise.)"""
        n, c, h, w = x.shape
        rows = x.reshape(-1, w).T.copy().sum(axis=0)
        return rows.reshape(-1, h).T.copy().sum(axis=0).reshape(n, c, 1, 1)

    def _ave_divisor(self, xp, dtype):
        """Window areas clipped to the padded image [-pad, size + pad), as Caffe counts them."""
        if self._divisor is None or self._divisor.dtype != dtype:
            sizes = []
            for size, k, s, p, o in zip(self.in_hw, self.kernel, self.stride, self.pad,
                                        self.out_hw):
                start = np.arange(o) * s - p
                sizes.append(np.minimum(start + k, size + p) - start)
            self._divisor = xp.asarray(np.outer(*sizes), dtype)
        return self._divisor

    def _flat_index(self, xp, rows, cols):
        """Position ``h * W + w`` in the unpadded input from window-relative rows and cols."""
        (sh, sw), (ph, pw), (oh, ow) = self.stride, self.pad, self.out_hw
        h = rows + xp.arange(-ph, oh * sh - ph, sh).reshape(-1, 1)
        w = cols + xp.arange(-pw, ow * sw - pw, sw)
        return h * self.in_hw[1] + w

    def forward(self, x, phase, rng):
        """The pooled ``x``."""
        xp = get_array_module(x)
        if self.method != 'MAX':        # sums of a half type (mixed precision) in float32
            x = x.astype(np.promote_types(x.dtype, np.float32), copy=False)
        if self.method == 'AVE':
            sums = self._whole_sums(x) if self.whole else self._window_sums(x)
            return sums / self._ave_divisor(xp, x.dtype)
        if self.method == 'MAX':
            return self._max_forward(x)
        if phase != TRAIN:     # Caffe's TEST-phase stochastic pooling: a weighted average
            total = self._window_sums(x)
            squares = self._window_sums(x * x)
            return xp.where(total > 0, squares / xp.where(total > 0, total, 1), 0)
        return self._stochastic_forward(x, rng)

    def _max_forward(self, x):
        xp = get_array_module(x)
        (kh, kw), (sh, sw), (oh, ow) = self.kernel, self.stride, self.out_hw
        padded = self._padded(x, -np.inf)
        row_max, col_in_window = _window_max(padded, 3, kw, sw, ow)
        top, row_in_window = _window_max(row_max, 2, kh, sh, oh)
        col = xp.zeros(top.shape, np.int16)
        for i in range(kh):    # the column of the maximum within the winning row
            col += (row_in_window == i) * _strided(col_in_window, 2, i, sh, oh)
        self.index = self._flat_index(xp, row_in_window, col)
        return top

    def _stochastic_forward(self, x, rng):
        """Caffe's GPU TRAIN rule: pick the first cell whose running sum reaches u * sum."""
        xp = get_array_module(x)
        (kh, kw), (sh, sw), (oh, ow) = self.kernel, self.stride, self.out_hw
        padded = self._padded(x, 0)
        st = padded.strides
        windows = xp.lib.stride_tricks.as_strided(
            padded, x.shape[:2] + (oh, ow, kh, kw), st[:2] + (st[2] * sh, st[3] * sw) + st[2:])
        windows = xp.ascontiguousarray(windows).reshape(x.shape[:2] + (oh, ow, kh * kw))
        running = xp.cumsum(windows, axis=-1)
        u = xp.asarray(rng.uniform(0, 1, x.shape[:2] + (oh, ow)), x.dtype)
        chosen = xp.argmax(running >= (u * running[..., -1])[..., None], axis=-1)
        self.index = self._flat_index(xp, chosen // kw, chosen % kw)
        return xp.take_along_axis(windows, chosen[..., None], axis=-1)[..., 0]

    def backward(self, dy, phase):
        """dx from the top diff ``dy``."""
        xp = get_array_module(dy)
        n, c = dy.shape[:2]
        dy = dy.astype(np.promote_types(dy.dtype, np.float32), copy=False)   # sums, as above
        if self.method == 'AVE':
            (kh, kw), (sh, sw), (ph, pw) = self.kernel, self.stride, self.pad
            g = dy / self._ave_divisor(xp, dy.dtype)
            if self.whole:            # every cell gets its window's gradient once
                return xp.broadcast_to(g, (n, c) + self.in_hw)
            rows = _spread(g, 2, kh, sh, self.padded_hw[0])
            padded = _spread(rows, 3, kw, sw, self.padded_hw[1])
            return padded[:, :, ph:ph + self.in_hw[0], pw:pw + self.in_hw[1]]
        if self.method == 'STOCHASTIC' and phase != TRAIN:
            raise ValueError('STOCHASTIC pooling has no backward in the TEST phase (nor in Caffe)')
        plane = self.in_hw[0] * self.in_hw[1]
        target = self.index + xp.arange(0, n * c * plane, plane).reshape(n, c, 1, 1)
        dx = xp.zeros(n * c * plane, dy.dtype)
        if self.overlapping:
            scatter_add(dx, target.ravel(), dy.ravel())
        else:    # each input cell is in at most one window
            dx[target.ravel()] = dy.ravel()
        return dx.reshape((n, c) + self.in_hw)


def forward(pool, x, phase, rng, out):
    out[...] = pool.forward(x, phase, rng)


def mask(pool):
    """The MAX top mask: index ``h * W + w`` of each maximum, as Caffe writes it."""
    return pool.index


def backward(pool, dy, phase, out):
    out[...] = pool.backward(dy, phase)
