"""SSD's Permute: it reorders the axes (SSD's heads turn N x C x H x W into N x H x W x C
before they are flattened, so that each prior's numbers lie together)."""
from ...layer import Layer, register


@register('Permute')
class PermuteLayer(Layer):
    """Top axis i is bottom axis ``order[i]``; axes missing from ``order`` follow in
    their own order, so ``order: 0 order: 2 order: 3 order: 1`` is NCHW -> NHWC."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        if top[0] is bottom[0]:
            raise self.error('cannot run in place (the top is its bottom)')
        num_axes = bottom[0].num_axes
        given = [int(axis) for axis in self.param.permute_param.order]
        for axis in given:
            if axis >= num_axes:
                raise self.error('order %d is out of range for a bottom of %d axes (shape %s)'
                                 % (axis, num_axes, bottom[0].shape))
        if len(set(given)) != len(given):
            raise self.error('order %s repeats an axis' % given)
        self.order = tuple(given + [axis for axis in range(num_axes) if axis not in given])
        self.inverse = tuple(self.order.index(axis) for axis in range(num_axes))
        self.identity = self.order == tuple(range(num_axes))

    def reshape(self, bottom, top):
        if bottom[0].num_axes != len(self.order):
            raise self.error('bottom has %d axes (shape %s); the layer was set up for %d'
                             % (bottom[0].num_axes, bottom[0].shape, len(self.order)))
        top[0].reshape(tuple(bottom[0].shape[axis] for axis in self.order))

    def forward(self, bottom, top):
        if self.identity:
            top[0].data = bottom[0].data
        else:
            top[0].data[...] = self.xp.transpose(bottom[0].data, self.order)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = self.xp.transpose(top[0].diff, self.inverse)
