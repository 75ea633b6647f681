"""YOLOv2's Reorg (the passthrough layer), as darknet and the Caffe YOLO ports compute it
(docs/fork-layers.md).

Darknet's reorg is not the space-to-depth of other frameworks. It reads the bottom's
memory as (N, C / s^2, H, s, W, s) and writes it out as (N, s, s, C / s^2, H, W), which a
blob of shape (N, C * s^2, H / s, W / s) then holds: the channels and rows of the
result mix the bottom's in darknet's order, and weights trained behind it expect that
order. ``reverse`` runs the inverse permutation (top (N, C / s^2, H * s, W * s)).
"""
from ...layer import Layer, register

# the permutation's two views of one buffer, for a bottom (N, C, H, W) and stride s:
# (N, C / s^2, H, s, W, s) as darknet's out_index reads it, (N, s, s, C / s^2, H, W) as
# its in_index does; reorg goes from the first to the second, reverse the other way
_SPREAD_TO_STACKED = (0, 3, 5, 1, 2, 4)
_STACKED_TO_SPREAD = (0, 3, 4, 1, 5, 2)


def darknet_reorg(values, shape, stride, reverse, inverse=False):
    """The flat values of darknet's reorg_cpu over ``values``, a bottom of ``shape``
    (N, C, H, W): its forward=0 call, or forward=1 with ``reverse``; ``inverse`` undoes
    it (the backward)."""
    n, c, h, w = shape
    spread = (n, c // stride ** 2, h, stride, w, stride)
    stacked = (n, stride, stride, c // stride ** 2, h, w)
    if reverse != inverse:
        return values.reshape(stacked).transpose(_STACKED_TO_SPREAD).reshape(-1)
    return values.reshape(spread).transpose(_SPREAD_TO_STACKED).reshape(-1)


@register('Reorg')
class ReorgLayer(Layer):
    """Bottom (N, C, H, W); top (N, C * s^2, H / s, W / s), or with ``reverse``
    (N, C / s^2, H * s, W * s). The backward is the inverse permutation."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        p = self.param.reorg_param
        if not p.HasField('stride') or p.stride < 1:
            raise self.error('reorg_param needs a positive stride, got %s'
                             % (p.stride if p.HasField('stride') else 'none'))
        self.stride, self.reverse = p.stride, p.reverse

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        square = self.stride ** 2
        if len(shape) != 4:
            raise self.error('bottom must be (N, C, H, W), got %s' % (shape,))
        n, c, h, w = shape
        # darknet's index arithmetic assumes both; elsewhere it reads past the blob
        if c % square:
            raise self.error('stride %d: the channels (%d) must be a multiple of %d'
                             % (self.stride, c, square))
        if not self.reverse and (h % self.stride or w % self.stride):
            raise self.error('stride %d must divide the height and width, got %d x %d'
                             % (self.stride, h, w))
        if self.reverse:
            top[0].reshape((n, c // square, h * self.stride, w * self.stride))
        else:
            top[0].reshape((n, c * square, h // self.stride, w // self.stride))

    def forward(self, bottom, top):
        top[0].data[...] = darknet_reorg(bottom[0].data, bottom[0].shape, self.stride,
                                         self.reverse).reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        # the exact gradient of a permutation; the forks' backward reads an internal blob
        # that nothing writes and gives the bottom zeros (docs/fork-layers.md)
        if propagate_down[0]:
            bottom[0].diff[...] = darknet_reorg(top[0].diff, bottom[0].shape, self.stride,
                                                self.reverse, inverse=True
                                                ).reshape(bottom[0].shape)
