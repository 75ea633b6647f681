"""Softmax along one axis."""
from ...layer import Layer, register
from ..shape.layers import canonical_axis


@register('Softmax')
class SoftmaxLayer(Layer):
    """exp(x) normalized to sum 1 along ``axis``."""

    def reshape(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)
        self.axis = canonical_axis(self, bottom[0], self.param.softmax_param.axis)
        if bottom[0].shape[self.axis] == 0:
            raise self.error('the softmax axis %d of the bottom, shape %s, has size 0'
                             % (self.axis, bottom[0].shape))

    # both passes write their result's array in place (no temporaries of its size): at
    # small sizes the passes cost what their numpy calls cost

    def forward(self, bottom, top):
        xp = self.xp
        x, y = bottom[0].data, top[0].data
        xp.subtract(x, x.max(axis=self.axis, keepdims=True), out=y)
        xp.exp(y, out=y)
        y /= y.sum(axis=self.axis, keepdims=True)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            xp = self.xp
            y, dy, dx = top[0].data, top[0].diff, bottom[0].diff
            xp.subtract(dy, (dy * y).sum(axis=self.axis, keepdims=True), out=dx)
            dx *= y
