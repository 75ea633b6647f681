"""SSD's Normalize: it divides by the L2 norm (over C x H x W, or over the channels at each
position) and multiplies by a learned scale (one, or one per channel).
"""
import numpy as np

from ... import caffe_pb2
from ...layer import Layer, register


@register('Normalize')
class NormalizeLayer(Layer):
    """top = scale * x / sqrt(sum(x^2) + eps), the sum over C x H x W of each item
    (across_spatial, the default) or over C at each position; the scale is one learned
    number (channel_shared, the default) or one per channel (blob 0)."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        if bottom[0].num_axes < 2:
            raise self.error('bottom must have at least 2 axes (N, C, ...), got shape %s'
                             % (bottom[0].shape,))
        p = self.param.norm_param
        self.across_spatial = p.across_spatial
        self.channel_shared = p.channel_shared
        self.eps = p.eps
        channels = bottom[0].shape[1]
        if not self.blobs:
            filler = p.scale_filler if p.HasField('scale_filler') else \
                caffe_pb2.FillerParameter(type='constant', value=1)
            self.blobs.append(self.make_blob(() if self.channel_shared else (channels,),
                                             filler))
        want = 1 if self.channel_shared else channels
        if self.blobs[0].count != want:
            raise self.error('scale blob has %d values; channel_shared: %s wants %d'
                             % (self.blobs[0].count, str(self.channel_shared).lower(), want))

    def reshape(self, bottom, top):
        x = bottom[0]
        if x.num_axes < 2:
            raise self.error('bottom must have at least 2 axes (N, C, ...), got shape %s'
                             % (x.shape,))
        if not self.channel_shared and x.shape[1] != self.blobs[0].count:
            raise self.error('bottom has %d channels, the scale blob %d'
                             % (x.shape[1], self.blobs[0].count))
        top[0].reshape(x.shape)

    def _grouped(self, array):
        """``array`` as (N, C, positions); any of them may be 0."""
        return array.reshape(array.shape[:2] + (int(np.prod(array.shape[2:])),))

    def _scale(self):
        """The scale, broadcastable over (N, C, positions)."""
        return self.blobs[0].data.reshape(1, -1, 1)

    def forward(self, bottom, top):
        x = self._grouped(bottom[0].data)
        summed_axes = (1, 2) if self.across_spatial else (1,)
        # eps goes under the root in both modes, as in the fork
        self.norm = self.xp.sqrt((x * x).sum(axis=summed_axes, keepdims=True) + self.eps)
        top_data = self._grouped(top[0].data)
        self.xp.divide(x, self.norm, out=top_data)
        top_data *= self._scale()

    def backward(self, top, propagate_down, bottom):
        x = self._grouped(bottom[0].data)
        top_diff = self._grouped(top[0].diff)
        if self.wants_param_gradient(0):
            product = (x / self.norm) * top_diff
            if self.channel_shared:
                self.blobs[0].diff += product.sum().astype(self.dtype)
            else:
                self.blobs[0].diff += product.sum(axis=(0, 2)).astype(self.dtype)
        if not propagate_down[0]:
            return
        # d(x / n)/dx with n = sqrt(sum x^2 + eps): (g - x * <x, g> / n^2) / n, where
        # g is the diff already multiplied by the scale. (The fork multiplies by the
        # scale after the projection instead, which equals this only when every
        # channel has the same scale.)
        scaled_diff = top_diff * self._scale()
        summed_axes = (1, 2) if self.across_spatial else (1,)
        projection = (x * scaled_diff).sum(axis=summed_axes, keepdims=True) / (self.norm ** 2)
        bottom_diff = self._grouped(bottom[0].diff)
        bottom_diff[...] = (scaled_diff - x * projection) / self.norm
