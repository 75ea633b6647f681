"""caffe_ocr's ``Lstm`` (Junhyuk Oh's LSTM layer, the one its CRNN nets use), beside BVLC's
``LSTM`` (layers.py), whose step it shares (docs/fork-layers.md).

What differs from BVLC's LSTM:
* bottoms: x (T, N, ...) alone, or with a second bottom, the sequence continuation
  indicators (T, N) (or T * N values); without it each forward starts from zero states,
  with it from the last forward's final states, as the fork does;
* the blobs are [W_x (4H, D), W_h (4H, H), b (4H)], in that order (BVLC: W_x, b, W_h);
* ``lstm_param.clipping_threshold`` (> 0) clips the gradient of the gate inputs at each
  step of the backward, as the fork does.
The gate order (i, f, o, g) and the step are BVLC's. The backward is the exact gradient:
the fork adds W_h's gradient at steps whose continuation indicator is 0, where no W_h
term was added in the forward, and reads the indicator of item n at step t at t + n.
"""
from ...layer import Layer, register
from .layers import lstm_unit_backward, lstm_unit_forward


@register('Lstm')
class OcrLstmLayer(Layer):

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=1, maximum=2)
        self.check_tops(top, exact=1)
        p = self.param.lstm_param
        if p.num_output < 1:
            raise self.error('lstm_param.num_output must be positive, got %d' % p.num_output)
        if bottom[0].num_axes < 3:
            raise self.error('x must be (T, N, features), got %s' % (bottom[0].shape,))
        self.hidden = p.num_output
        self.clipping = p.clipping_threshold
        gates = 4 * self.hidden
        self.blobs = [self.make_blob((gates, bottom[0].count_range(2)), p.weight_filler),
                      self.make_blob((gates, self.hidden), p.weight_filler),
                      self.make_blob((gates,), p.bias_filler)]
        self.carried = None

    def reshape(self, bottom, top):
        x = bottom[0]
        if x.num_axes < 3 or x.count_range(2) != self.blobs[0].shape[1]:
            raise self.error('x must be (T, N, %d features), got %s'
                             % (self.blobs[0].shape[1], x.shape))
        steps, num = x.shape[:2]
        if len(bottom) > 1 and bottom[1].count != steps * num:
            raise self.error('the continuation indicators (bottom 1) must hold T x N = %d '
                             'values, got shape %s' % (steps * num, bottom[1].shape))
        top[0].reshape((steps, num, self.hidden))

    def continuation(self, bottom):
        """(T, N) indicators: the second bottom's, else 0 at the first step, then 1."""
        steps, num = bottom[0].shape[:2]
        if len(bottom) > 1:
            return bottom[1].data.reshape(steps, num).astype(self.dtype)
        cont = self.xp.ones((steps, num), self.dtype)
        cont[0] = 0
        return cont

    def forward(self, bottom, top):
        xp = self.xp
        steps, num = bottom[0].shape[:2]
        w_x, w_h, bias = (b.data for b in self.blobs)
        self.cont = self.continuation(bottom)
        projected = (bottom[0].data.reshape(steps * num, -1) @ w_x.T + bias).reshape(
            steps, num, -1)
        zeros = xp.zeros((num, self.hidden), self.dtype)
        h, c = zeros, zeros
        if len(bottom) > 1 and self.carried is not None and self.carried[0].shape == h.shape:
            h, c = self.carried
        output = xp.empty(top[0].shape, self.dtype)
        self.conted = xp.empty(top[0].shape, self.dtype)
        self.caches = []
        for t in range(steps):
            self.conted[t] = self.cont[t][:, None] * h
            c, h, cache = lstm_unit_forward(xp, projected[t] + self.conted[t] @ w_h.T, c,
                                            self.cont[t])
            self.caches.append(cache)
            output[t] = h
        self.carried = (h, c)
        top[0].data[...] = output

    def backward(self, top, propagate_down, bottom):
        xp = self.xp
        steps, num = bottom[0].shape[:2]
        w_x, w_h = self.blobs[0].data, self.blobs[1].data
        dgates = xp.empty((steps, num, 4 * self.hidden), self.dtype)
        dh_next = dc = xp.zeros((num, self.hidden), self.dtype)
        for t in reversed(range(steps)):
            dgates[t], dc = lstm_unit_backward(xp, self.caches[t], dc, top[0].diff[t] + dh_next)
            if self.clipping > 0:
                dgates[t] = xp.clip(dgates[t], -self.clipping, self.clipping)
            dh_next = self.cont[t][:, None] * (dgates[t] @ w_h)
        flat = dgates.reshape(steps * num, -1)
        if self.wants_param_gradient(0):
            self.blobs[0].diff += flat.T @ bottom[0].data.reshape(steps * num, -1)
        if self.wants_param_gradient(1):
            self.blobs[1].diff += flat.T @ self.conted.reshape(steps * num, -1)
        if self.wants_param_gradient(2):
            self.blobs[2].diff += flat.sum(axis=0)
        if propagate_down[0]:
            bottom[0].diff[...] = (flat @ w_x).reshape(bottom[0].shape)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0
