"""SegNet's Upsample (with the YOLO ports' nearest-neighbour form), as the fork computes it
(docs/fork-layers.md), in array code that runs on numpy and CuPy alike.
"""
import numpy as np

from ...layer import Layer, register


@register('Upsample')
class UpsampleLayer(Layer):
    """With a second bottom (a MAX Pooling layer's mask top), SegNet's unpooling: each value
    goes to the position ``h * W + w`` its mask names in a zero plane of upsample_h x
    upsample_w (or H * scale_h - pad_out_h by W * scale_w - pad_out_w). With one bottom, the
    YOLO ports' (darknet2caffe's) nearest-neighbour upsampling by ``scale``."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=1, maximum=2)
        self.check_tops(top, exact=1)
        up = self.param.upsample_param
        self.unpooling = len(bottom) == 2
        self.fixed_hw = None
        if up.HasField('upsample_h') != up.HasField('upsample_w'):
            raise self.error('upsample_h and upsample_w go together; got only %s'
                             % ('upsample_h' if up.HasField('upsample_h') else 'upsample_w'))
        if up.HasField('scale_h') != up.HasField('scale_w'):
            raise self.error('scale_h and scale_w go together; got only %s'
                             % ('scale_h' if up.HasField('scale_h') else 'scale_w'))
        if up.HasField('upsample_h'):
            if not self.unpooling:
                raise self.error('upsample_h/upsample_w need the pooling mask as bottom 1; '
                                 'with one bottom give scale')
            self.fixed_hw = (up.upsample_h, up.upsample_w)
            if min(self.fixed_hw) < 2:
                raise self.error('upsample_h and upsample_w must be at least 2, got %d x %d'
                                 % self.fixed_hw)
            return
        if up.HasField('scale_h') and up.HasField('scale'):
            raise self.error('give scale or scale_h/scale_w, not both')
        self.scale = (up.scale_h, up.scale_w) if up.HasField('scale_h') else (up.scale,) * 2
        self.pad_out = (int(up.pad_out_h), int(up.pad_out_w))
        if min(self.scale) < 1 or (self.unpooling and min(self.scale) < 2):
            raise self.error('scale must be at least %d, got %s'
                             % (2 if self.unpooling else 1, self.scale))
        for axis, scale, pad in zip('hw', self.scale, self.pad_out):
            if pad and (scale != 2 or not self.unpooling):
                raise self.error('pad_out_%s needs the mask bottom and scale_%s 2, got scale %d '
                                 'and %d bottom(s)' % (axis, axis, scale, len(bottom)))

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.error('bottom 0 must be (N, C, H, W), got shape %s' % (shape,))
        if self.unpooling and bottom[1].shape != shape:
            raise self.error('the mask (bottom 1) must have the shape of bottom 0 %s, got %s'
                             % (shape, bottom[1].shape))
        if self.fixed_hw is not None:
            self.out_hw = self.fixed_hw
        else:
            self.out_hw = tuple(size * scale - pad for size, scale, pad in
                                zip(shape[2:], self.scale, self.pad_out))
        top[0].reshape(shape[:2] + self.out_hw)

    def _flat_targets(self, bottom):
        """Each input value's index in the flattened top: its plane's start + its mask."""
        xp = self.xp
        planes, plane = bottom[0].shape[0] * bottom[0].shape[1], self.out_hw[0] * self.out_hw[1]
        index = bottom[1].data.reshape(planes, bottom[1].count // max(planes, 1)).astype(np.int64)
        if index.size == 0:
            return index.reshape(-1)
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= plane:
            raise self.error('mask index %d is outside the %d x %d top plane: the Pooling layer '
                             "that made the mask must have had this layer's top size as input"
                             % (high if high >= plane else low, *self.out_hw))
        return (index + xp.arange(planes, dtype=np.int64)[:, None] * plane).reshape(-1)

    def forward(self, bottom, top):
        x = bottom[0].data
        if not self.unpooling:
            sh, sw = self.scale
            top[0].data[...] = x.repeat(sh, axis=2).repeat(sw, axis=3)
            return
        out = top[0].data.reshape(-1)
        out[...] = 0
        # where a mask repeats an index (overlapping pooling windows) the last value in
        # row-major order stays, as in the fork's loop
        out[self._flat_targets(bottom)] = x.reshape(-1)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff
        if not self.unpooling:
            (sh, sw), (n, c, h, w) = self.scale, bottom[0].shape
            bottom[0].diff[...] = dy.reshape(n, c, h, sh, w, sw).sum(axis=(3, 5))
            return
        # the fork hands every input the diff at its mask position, repeated or not
        bottom[0].diff[...] = dy.reshape(-1)[self._flat_targets(bottom)].reshape(
            bottom[0].shape)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0          # bottom 1 holds indices
