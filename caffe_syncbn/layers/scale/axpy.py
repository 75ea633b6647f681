"""SENet's Axpy, as the fork computes it (docs/fork-layers.md)."""
from ...layer import Layer, register


@register('Axpy')
class AxpyLayer(Layer):
    """SENet's Axpy: ``top = a * x + y`` for bottoms (a, x, y); a holds one scale per image
    and channel, (N, C) or (N, C, 1, 1)."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=3)
        self.check_tops(top, exact=1)

    def reshape(self, bottom, top):
        a, x, y = (b.shape for b in bottom)
        if len(x) < 2 or a[:2] != x[:2] or any(d != 1 for d in a[2:]):
            raise self.error('bottom 0 (the scale) must be (N, C) or (N, C, 1, 1) of bottom 1 '
                             'shape %s, got %s' % (x, a))
        if y != x:
            raise self.error('bottoms 1 and 2 must have one shape, got %s and %s' % (x, y))
        top[0].reshape(x)

    def _scale(self, bottom):
        x = bottom[1]
        return bottom[0].data.reshape(x.shape[:2] + (1,) * (x.num_axes - 2))

    def forward(self, bottom, top):
        top[0].data[...] = self._scale(bottom) * bottom[1].data + bottom[2].data

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.copy() if any(top[0] is b for b in bottom) else top[0].diff
        if propagate_down[0]:
            spatial = tuple(range(2, bottom[1].num_axes))
            bottom[0].diff[...] = (dy * bottom[1].data).sum(axis=spatial).reshape(
                bottom[0].shape)
        if propagate_down[1]:
            bottom[1].diff[...] = self._scale(bottom) * dy
        if propagate_down[2]:
            bottom[2].diff[...] = dy
