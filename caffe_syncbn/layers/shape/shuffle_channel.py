"""ShuffleNet's ShuffleChannel, as the fork computes it (docs/fork-layers.md)."""
import math

from ...layer import Layer, register


@register('ShuffleChannel')
class ShuffleChannelLayer(Layer):
    """ShuffleNet's channel shuffle: channels as (group, C / group), transposed."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        self.group = self.param.shuffle_channel_param.group
        if self.group < 1:
            raise self.error('group must be positive, got %d' % self.group)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) < 2 or shape[1] % self.group:
            raise self.error('group %d must divide the channels (axis 1) of the bottom, shape %s'
                             % (self.group, shape))
        top[0].reshape(shape)

    @staticmethod
    def _shuffle(array, rows):
        """``array``'s channels read as a (rows, C / rows) matrix, transposed."""
        n, c = array.shape[:2]
        positions = int(math.prod(array.shape[2:]))          # an empty axis makes 0, not -1's guess
        return array.reshape(n, rows, c // rows, positions).swapaxes(1, 2).reshape(array.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self._shuffle(bottom[0].data, self.group)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:      # the inverse permutation: the transpose the other way
            c = bottom[0].shape[1]
            bottom[0].diff[...] = self._shuffle(top[0].diff, c // self.group)
