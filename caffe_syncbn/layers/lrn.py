"""Local response normalization, across channels or within each channel.

Both regions compute ``y = x * scale^-beta`` with ``scale = k + alpha/m * (window sum of
x^2)``, where m is the window's cell count (local_size, or local_size^2 within a channel,
where k is 1 as in Caffe).  Windows are centred, zero-padded sums; being symmetric, the
same sum serves the backward pass.
"""
from .. import caffe_pb2
from ..layer import Layer, register


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

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error('expects a 4-axis (N, C, H, W) bottom, got shape %s'
                             % (bottom[0].shape,))
        top[0].reshape(bottom[0].shape)

    def _window_sum(self, a):
        if self.across:
            return centered_window_sum(a, 1, self.size)
        return centered_window_sum(centered_window_sum(a, 2, self.size), 3, self.size)

    def forward(self, bottom, top):
        if self.cuda_kernels and self.across:
            from ..gpu import lrn_gpu
            lrn_gpu.forward(self, bottom, top)
            return
        x = bottom[0].data
        self._scale = self.k + (self.alpha / self.cells) * self._window_sum(x * x)
        top[0].data[...] = x * self._scale ** -self.beta

    def backward(self, top, propagate_down, bottom):
        if self.cuda_kernels and self.across:
            from ..gpu import lrn_gpu
            lrn_gpu.backward(self, top, propagate_down, bottom)
            return
        if not propagate_down[0]:
            return
        x, y, dy, scale = bottom[0].data, top[0].data, top[0].diff, self._scale
        through_scale = self._window_sum(dy * y / scale)
        bottom[0].diff[...] = (dy * scale ** -self.beta
                               - (2 * self.alpha * self.beta / self.cells) * x * through_scale)
