"""Local response normalization, across channels or within each channel.

Both regions compute ``y = x * scale^-beta`` with ``scale = k + alpha/m * (window sum of
x^2)``, where m is the window's cell count (local_size, or local_size^2 within a channel,
where k is 1 as in Caffe).  Windows are centred, zero-padded sums; being symmetric, the
same sum serves the backward pass.
"""
import math
import numpy as np

from ... import caffe_pb2
from ...backend import cpu_threads
from ...layer import Layer, register
from . import gpu as lrn_gpu

#: the host path works on this many bytes of one image's positions at a time
BAND_BYTES = 4 << 20


def centered_window_sum(a, axis, size):
    """Sum over the ``size`` cells centred on each cell along ``axis`` (zeros outside)."""
    total = a.copy()
    lead = (slice(None),) * axis
    for d in range(1, (size - 1) // 2 + 1):
        total[lead + (slice(d, None),)] += a[lead + (slice(None, -d),)]
        total[lead + (slice(None, -d),)] += a[lead + (slice(d, None),)]
    return total


@register('LRN')
class LRNLayer(Layer):

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        lp = self.param.lrn_param
        self.size = lp.local_size
        if self.size < 1 or self.size % 2 == 0:
            raise self.error('local_size must be odd and positive, got %d' % self.size)
        self.alpha, self.beta = lp.alpha, lp.beta
        self.across = lp.norm_region == caffe_pb2.LRNParameter.ACROSS_CHANNELS
        self.k = lp.k if self.across else 1.0
        self.cells = self.size if self.across else self.size ** 2
        self._scale = None
        # the engine, chosen once: ACROSS_CHANNELS runs on the CUDA kernels, or on the
        # host's banded passes over numpy; WITHIN_CHANNEL runs as array code
        self.kernels = lrn_gpu if self.cuda_kernels and self.across else None
        self.host = self.across and self.xp is np and not self.cuda_kernels

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error('expects a 4-axis (N, C, H, W) bottom, got shape %s'
                             % (bottom[0].shape,))
        top[0].reshape(bottom[0].shape)

    def _window_sum(self, a):
        if self.across:
            return centered_window_sum(a, 1, self.size)
        return centered_window_sum(centered_window_sum(a, 2, self.size), 3, self.size)

    def _bands(self, shape, work):
        """``work(n, band)`` over images and bands of positions of (N, C, H*W) arrays, about
        BAND_BYTES each, split over threads: across channels, positions are independent.
        (Narrower bands, strided in memory, ran slower than whole images.)"""
        n, c = shape[:2]
        positions = int(math.prod(shape[2:]))
        width = max(1, BAND_BYTES // (4 * max(c, 1)))      # 0 channels: empty bands
        bands = [(i, slice(p, min(positions, p + width)))
                 for i in range(n) for p in range(0, positions, width)]

        def part(a, b):
            for i, band in bands[a:b]:
                work(i, band)
        cpu_threads.split(len(bands), part)

    def _host_forward(self, x, y):
        x3, y3 = (_as_3d(a) for a in (x, y))
        if self._scale is None or self._scale.shape != x3.shape or self._scale.dtype != x.dtype:
            self._scale = np.empty_like(x3)          # kept from one forward to the next
        scale = self._scale

        def work(i, band):
            s = scale[i, :, band]
            xs = x3[i, :, band]
            np.multiply(xs, xs, out=s)
            s[...] = centered_window_sum(s, 0, self.size)
            s *= self.alpha / self.cells
            s += self.k
            np.multiply(xs, s ** -self.beta, out=y3[i, :, band])
        self._bands(x.shape, work)

    def _host_backward(self, x, y, dy, dx):
        x3, y3, dy3, dx3 = (_as_3d(a) for a in (x, y, dy, dx))
        factor = 2 * self.alpha * self.beta / self.cells

        def work(i, band):
            s, g = self._scale[i, :, band], dy3[i, :, band]
            through = g * y3[i, :, band]
            through /= s
            through = centered_window_sum(through, 0, self.size)
            through *= x3[i, :, band]
            through *= factor
            # dy is read before dx is written (in place they are one array)
            np.multiply(g, s ** -self.beta, out=dx3[i, :, band])
            dx3[i, :, band] -= through
        self._bands(x.shape, work)

    def forward(self, bottom, top):
        if self.kernels is not None:
            self.kernels.forward(self, bottom, top)
            return
        x = bottom[0].data
        if self.host:
            self._host_forward(x, top[0].data)
            return
        self._scale = self.k + (self.alpha / self.cells) * self._window_sum(x * x)
        top[0].data[...] = x * self._scale ** -self.beta

    def backward(self, top, propagate_down, bottom):
        if self.kernels is not None:
            self.kernels.backward(self, top, propagate_down, bottom)
            return
        if not propagate_down[0]:
            return
        if self.host:
            self._host_backward(bottom[0].data, top[0].data, top[0].diff, bottom[0].diff)
            return
        x, y, dy, scale = bottom[0].data, top[0].data, top[0].diff, self._scale
        through_scale = self._window_sum(dy * y / scale)
        bottom[0].diff[...] = (dy * scale ** -self.beta
                               - (2 * self.alpha * self.beta / self.cells) * x * through_scale)


def _as_3d(a):
    """(N, C, H*W) of an (N, C, H, W) array, also where an axis has size 0."""
    return a.reshape(a.shape[0], a.shape[1], a.shape[2] * a.shape[3])
