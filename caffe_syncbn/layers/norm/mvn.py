"""MVN: mean-variance normalization of each item (and channel)."""
from ...layer import Layer, register


@register('MVN')
class MVNLayer(Layer):
    """Subtracts the mean and (normalize_variance) divides by ``std + eps`` over each
    (item, channel), or each item with across_channels. As in Caffe, eps is added to
    the standard deviation, and the backward treats ``std + eps`` as ``std``."""

    def reshape(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)
        x = bottom[0]
        if x.num_axes < 1:
            raise self.error('needs a bottom with >= 1 axis, got shape %s' % (x.shape,))
        groups_end = 1 if self.param.mvn_param.across_channels else min(2, x.num_axes)
        self.groups = x.count_range(0, groups_end)
        self.group_size = x.count_range(groups_end)
        if self.group_size == 0:
            raise self.error('the bottom, shape %s, has groups of 0 values to normalize'
                             % (x.shape,))

    def forward(self, bottom, top):
        p = self.param.mvn_param
        x = bottom[0].data.reshape(self.groups, self.group_size)
        centered = x - x.mean(axis=1, keepdims=True)
        if p.normalize_variance:
            self.std = self.xp.sqrt((centered * centered).mean(axis=1, keepdims=True)) + p.eps
            centered /= self.std
        top[0].data[...] = centered.reshape(bottom[0].shape)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff.reshape(self.groups, self.group_size)
        dx = dy - dy.mean(axis=1, keepdims=True)
        if self.param.mvn_param.normalize_variance:
            y = top[0].data.reshape(self.groups, self.group_size)
            dx -= y * (y * dy).mean(axis=1, keepdims=True)
            dx /= self.std
        bottom[0].diff[...] = dx.reshape(bottom[0].shape)
