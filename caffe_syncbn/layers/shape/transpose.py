"""caffe_ocr's Transpose and Reverse, the layers its CRNN nets put between the
convolutions and the LSTMs (docs/fork-layers.md)."""
from ...layer import Layer, register
from .layers import canonical_axis


@register('Transpose')
class TransposeLayer(Layer):
    """Top axis i is bottom axis ``dim[i]``: ``dim: 3 dim: 2 dim: 0 dim: 1`` turns
    N x C x H x W into W x H x N x C. ``dim`` names every axis of the bottom once."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        if bottom[0] is top[0]:
            raise self.error('cannot run in place (the fork refuses it too)')
        self.dims = list(self.param.transpose_param.dim)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if sorted(self.dims) != list(range(len(shape))):
            raise self.error('transpose_param must list each of the bottom\'s %d axes once, '
                             'got dim %s for shape %s' % (len(shape), self.dims, shape))
        top[0].reshape(tuple(shape[d] for d in self.dims))

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data.transpose(self.dims)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            inverse = sorted(range(len(self.dims)), key=self.dims.__getitem__)
            bottom[0].diff[...] = top[0].diff.transpose(inverse)


@register('Reverse')
class ReverseLayer(Layer):
    """The bottom with the order along ``reverse_param.axis`` (default 0, time in a
    recurrent net) reversed."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        if bottom[0] is top[0]:
            raise self.error('cannot run in place (the fork refuses it too)')

    def reshape(self, bottom, top):
        axis = self.param.reverse_param.axis
        if axis < 0:                   # the fork checks axis >= 0 when it builds the layer
            raise self.error('reverse_param.axis must be >= 0, got %d' % axis)
        self.axis = canonical_axis(self, bottom[0], axis)
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.xp.flip(bottom[0].data, self.axis)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = self.xp.flip(top[0].diff, self.axis)
