"""SmoothL1Loss of py-faster-rcnn and of Wei Liu's SSD fork, one layer type for both.

With d = w_in * (b0 - b1) the loss is sum(w_out * f(d)) / N, where
f(d) = 0.5 * (sigma * d)^2 if |d| < 1 / sigma^2, else |d| - 0.5 / sigma^2, N is bottom 0's
first axis, and the bottoms say which fork's form it is:
  2 bottoms (b0, b1)                  both forks: w_in = w_out = 1
  3 bottoms (b0, b1, w)               the SSD fork: w_in = w, w_out = 1 (sigma: its fixed 1)
  4 bottoms (b0, b1, w_in, w_out)     py-faster-rcnn
Both forks divide by N whatever loss_param says.
"""
from ...layer import register
from .layers import BATCH_SIZE, LossLayer


@register('SmoothL1Loss')
class SmoothL1LossLayer(LossLayer):

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=2, maximum=4)
        self.check_tops(top, exact=1)
        sigma = self.param.smooth_l1_loss_param.sigma
        if sigma == 0:
            raise self.error('sigma must be nonzero, got 0')
        self.sigma2 = sigma * sigma

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != shape:
                raise self.error('bottom %d must have the shape of bottom 0 %s, got %s'
                                 % (i, shape, b.shape))
        top[0].reshape(())

    def forward(self, bottom, top):
        xp = self.xp
        d = self.full_values(bottom[0]) - self.full_values(bottom[1])
        if len(bottom) > 2:
            d *= bottom[2].data
        inside = xp.abs(d) < 1 / self.sigma2
        errors = xp.where(inside, 0.5 * self.sigma2 * d * d, xp.abs(d) - 0.5 / self.sigma2)
        # the slope of f at d, kept for the backward
        self.slope = xp.where(inside, self.sigma2 * d, xp.sign(d))
        for weights in bottom[3:]:
            errors *= weights.data
        self.set_loss(top, errors.sum(), self.normalizer(BATCH_SIZE, bottom[0].shape[0]))

    def backward(self, top, propagate_down, bottom):
        # d loss / d b0 = slope * w_in * w_out / N. The SSD fork's own backward leaves out its
        # w_in; the two agree wherever w_in is 0 or 1, the only weights that fork feeds it.
        grad = self.slope * self.grad_scale(top)
        for weights in bottom[2:]:
            grad = grad * weights.data
        for i, sign in ((0, 1), (1, -1)):
            if propagate_down[i]:
                bottom[i].diff[...] = sign * grad
        for i in range(2, len(bottom)):
            if propagate_down[i]:
                raise self.error('cannot backpropagate to bottom %d (weights)' % i)

    def allow_force_backward(self, bottom_index):
        return bottom_index < 2
