"""The CRNN ports' ContinuationIndicator (crnn.caffe): the sequence indicator that BVLC's
LSTM and RNN take as their second bottom, for sequences that fill every step."""
from ...layer import Layer, register


@register('ContinuationIndicator')
class ContinuationIndicatorLayer(Layer):
    """A top of shape (time_step, batch_size): 0 at the first step (a sequence starts),
    1 at every later one. No bottom, nothing to learn."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=0)
        self.check_tops(top, exact=1)
        p = self.param.continuation_indicator_param
        for name in ('time_step', 'batch_size'):
            if getattr(p, name) < 1:
                raise self.error('continuation_indicator_param.%s must be at least 1, got %d'
                                 % (name, getattr(p, name)))
        self.shape = (p.time_step, p.batch_size)

    def reshape(self, bottom, top):
        top[0].reshape(self.shape)

    def forward(self, bottom, top):
        top[0].data[...] = 1
        top[0].data[0] = 0

    def backward(self, top, propagate_down, bottom):
        """Nothing below it."""
