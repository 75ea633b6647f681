"""Pooling (MAX, AVE, STOCHASTIC) and SPP (spatial pyramid pooling) on (N, C, H, W) blobs.

Window reductions are separable: a strided slice per kernel column reduces along W,
then a strided slice per kernel row along H, so no (windows x kernel) array is built.
MAX keeps the position of each maximum (the first in row-major order, as Caffe does),
and its backward scatters through those positions.
"""
import numpy as np

from ... import caffe_pb2
from ...backend import get_array_module
from ...layer import TRAIN, Layer, register
from . import gpu as pooling_gpu, host as pooling_cpu


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
        self._index = None
        self._offsets = None          # of the maxima, on the host path (pooling_cpu)
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

    def forward(self, x, phase, rng, out=None):
        """The pooled ``x``; ``out`` (optional) receives it."""
        self._offsets = None
        if pooling_cpu.applies(self, x):
            if out is None:
                out = np.empty(x.shape[:2] + self.out_hw, x.dtype)
            self._offsets = pooling_cpu.forward(self, x, out)
            return out
        result = self._forward(x, phase, rng)
        if out is None:
            return result
        out[...] = result
        return out

    def _forward(self, x, phase, rng):
        xp = get_array_module(x)
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
        self._index = self._flat_index(xp, row_in_window, col)
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
        self._index = self._flat_index(xp, chosen // kw, chosen % kw)
        return xp.take_along_axis(windows, chosen[..., None], axis=-1)[..., 0]

    def mask(self):
        """The MAX top mask: index ``h * W + w`` of each maximum, as Caffe writes it."""
        if self._offsets is not None:
            return pooling_cpu.flat_index(self, self._offsets)
        return self._index

    def backward(self, dy, phase, out=None):
        """dx from the top diff ``dy``; ``out`` (optional) receives it."""
        if self._offsets is not None:
            if out is None:
                out = np.empty(dy.shape[:2] + self.in_hw, dy.dtype)
            pooling_cpu.backward(self, self._offsets, dy, out)
            return out
        result = self._backward(dy, phase)
        if out is None:
            return result
        out[...] = result
        return out

    def _backward(self, dy, phase):
        xp = get_array_module(dy)
        n, c = dy.shape[:2]
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
        target = self._index + xp.arange(0, n * c * plane, plane).reshape(n, c, 1, 1)
        dx = xp.zeros(n * c * plane, dy.dtype)
        if self.overlapping:
            scatter_add(dx, target.ravel(), dy.ravel())
        else:    # each input cell is in at most one window
            dx[target.ravel()] = dy.ravel()
        return dx.reshape((n, c) + self.in_hw)


def _pool_geometry(layer, pp, in_hw):
    """kernel, stride, pad pairs from a PoolingParameter (global pooling: the whole input)."""
    if pp.global_pooling:
        if pp.HasField('kernel_size') or pp.HasField('kernel_h') or pp.HasField('kernel_w'):
            raise layer.error('global_pooling takes the whole input; do not give a kernel size')
        kernel = tuple(in_hw)
    elif pp.HasField('kernel_h') or pp.HasField('kernel_w'):
        if pp.HasField('kernel_size'):
            raise layer.error('give kernel_size or kernel_h/kernel_w, not both')
        if not (pp.HasField('kernel_h') and pp.HasField('kernel_w')):
            raise layer.error('a non-square kernel needs both kernel_h and kernel_w')
        kernel = (pp.kernel_h, pp.kernel_w)
    elif pp.HasField('kernel_size'):
        kernel = (pp.kernel_size, pp.kernel_size)
    else:
        raise layer.error('kernel_size (or kernel_h and kernel_w, or global_pooling) is required')
    pad = (pp.pad_h, pp.pad_w) if pp.HasField('pad_h') or pp.HasField('pad_w') else (pp.pad,) * 2
    if pp.HasField('stride_h') or pp.HasField('stride_w'):
        stride = (pp.stride_h, pp.stride_w)
    else:
        stride = (pp.stride,) * 2
    if pp.global_pooling and (any(pad) or stride != (1, 1)):
        raise layer.error('global_pooling needs pad 0 and stride 1, got pad %s stride %s'
                          % (pad, stride))
    return kernel, stride, pad


def _require_4d(layer, blob):
    if blob.num_axes != 4:
        raise layer.error('expects a 4-axis (N, C, H, W) bottom, got shape %s' % (blob.shape,))


@register('Pooling')
class PoolingLayer(Layer):

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        pp = self.param.pooling_param
        self.method = caffe_pb2.PoolingParameter.PoolMethod.Name(pp.pool)
        self.check_tops(top, minimum=1, maximum=2 if self.method == 'MAX' else 1)
        self.pool = None
        # the engine, chosen once: the CUDA kernels for MAX and AVE, else Pool2d's own code
        self.kernels = pooling_gpu if self.cuda_kernels and self.method in ('MAX', 'AVE') \
            else None

    def reshape(self, bottom, top):
        _require_4d(self, bottom[0])
        pp = self.param.pooling_param
        in_hw = bottom[0].shape[2:]
        if self.pool is None or self.pool.in_hw != in_hw:
            kernel, stride, pad = _pool_geometry(self, pp, in_hw)
            self.pool = Pool2d(self.method, in_hw, kernel, stride, pad,
                               pp.round_mode == pp.CEIL, self.error)
        for t in top:
            t.reshape(bottom[0].shape[:2] + self.pool.out_hw)

    def forward(self, bottom, top):
        if self.kernels is not None:
            top[0].data[...] = self.kernels.forward(self.pool, bottom[0].data)
        else:
            self.pool.forward(bottom[0].data, self.phase, self.ctx.rng, out=top[0].data)
        if len(top) > 1:
            top[1].data[...] = self.pool.mask()

    def backward_reads(self, bottom, top):
        return []                   # MAX keeps its mask; AVE and STOCHASTIC's TEST are linear

    def rerunnable(self):
        return self.method != 'STOCHASTIC'      # which draws its samples anew

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        try:
            if self.kernels is not None:
                bottom[0].diff[...] = self.kernels.backward(self.pool, top[0].diff)
            else:
                self.pool.backward(top[0].diff, self.phase, out=bottom[0].diff)
        except ValueError as e:
            raise self.error(str(e)) from None


@register('SPP')
class SPPLayer(Layer):
    """Pools at 1, 2, 4, ... bins per side and concatenates the flattened results."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        sp = self.param.spp_param
        self.height = sp.pyramid_height
        if self.height < 1:
            raise self.error('pyramid_height must be positive, got %d' % self.height)
        self.method = caffe_pb2.SPPParameter.PoolMethod.Name(sp.pool)
        self.levels = []

    def reshape(self, bottom, top):
        _require_4d(self, bottom[0])
        in_hw = bottom[0].shape[2:]
        n, c = bottom[0].shape[:2]
        if not (self.levels and self.levels[0].in_hw == in_hw):
            self.levels = self._pyramid(in_hw)
        if self.height == 1:       # Caffe then gives the pooling top itself, 4-D
            top[0].reshape((n, c) + self.levels[0].out_hw)
        else:
            top[0].reshape(n, sum(c * int(np.prod(p.out_hw)) for p in self.levels))

    def _pyramid(self, in_hw):
        levels = []
        for level in range(self.height):
            bins = 2 ** level
            kernel = tuple(-(-size // bins) for size in in_hw)
            pad = tuple((k * bins - size + 1) // 2 for k, size in zip(kernel, in_hw))
            levels.append(Pool2d(self.method, in_hw, kernel, kernel, pad, True, self.error))
        return levels

    def forward(self, bottom, top):
        x = bottom[0].data
        pooled = [p.forward(x, self.phase, self.ctx.rng).reshape(x.shape[0], -1)
                  for p in self.levels]
        top[0].data[...] = self.xp.concatenate(pooled, axis=1).reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        n, c = bottom[0].shape[:2]
        dy = top[0].diff.reshape(n, -1)
        dx = None
        start = 0
        for p in self.levels:
            count = c * int(np.prod(p.out_hw))
            part = dy[:, start:start + count].reshape((n, c) + p.out_hw)
            start += count
            try:
                grad = p.backward(part, self.phase)
            except ValueError as e:
                raise self.error(str(e)) from None
            dx = grad if dx is None else dx + grad
        bottom[0].diff[...] = dx
