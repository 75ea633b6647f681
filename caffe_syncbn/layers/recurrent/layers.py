"""Recurrent layers: LSTMUnit (one LSTM step), LSTM and RNN.

Caffe builds LSTM/RNN as an unrolled internal net; here the same maths runs as a loop over
the T time steps with whole-batch matrix products inside each step. The learnable blobs keep
Caffe's order and shapes so caffemodels load unchanged:
  LSTM: W_xc (4H, D), b_c (4H), [W_xc_static (4H, Ds)], W_hc (4H, H)
  RNN:  W_xh (H, D),  b_h (H),  [W_xh_static (H, Ds)],  W_hh (H, H), W_ho (H, H), b_o (H)
Bottoms: x (T, N, ...), cont (T, N) (0 starts a new sequence; no gradient), optional static
input (N, ...), then with expose_hidden the initial states (1, N, H). Tops: the outputs
(T, N, H), then with expose_hidden the final states (1, N, H). Gate order is i, f, o, g.
"""
from ...layer import Layer, register


def _sigmoid(xp, x):
    return 1 / (1 + xp.exp(-x))


def lstm_unit_forward(xp, gates, c_prev, cont):
    """One LSTM step on (N, 4H) gate inputs; ``cont`` (N,) scales the forget gate."""
    hidden = c_prev.shape[-1]
    i = _sigmoid(xp, gates[:, :hidden])
    f = cont[:, None] * _sigmoid(xp, gates[:, hidden:2 * hidden])
    o = _sigmoid(xp, gates[:, 2 * hidden:3 * hidden])
    g = xp.tanh(gates[:, 3 * hidden:])
    c = f * c_prev + i * g
    tanh_c = xp.tanh(c)
    return c, o * tanh_c, (i, f, o, g, c_prev, tanh_c)


def lstm_unit_backward(xp, cache, dc, dh):
    """Gradients of the gate inputs and of c_prev from those of c and h.

    As in Caffe, the forget-gate term uses f = cont * sigmoid, so it is the exact
    derivative when cont is 0 or 1 (the only values it takes in practice)."""
    i, f, o, g, c_prev, tanh_c = cache
    dc_total = dc + dh * o * (1 - tanh_c * tanh_c)
    dgates = xp.concatenate([dc_total * g * i * (1 - i),
                             dc_total * c_prev * f * (1 - f),
                             dh * tanh_c * o * (1 - o),
                             dc_total * i * (1 - g * g)], axis=1)
    return dgates, dc_total * f


@register('LSTMUnit')
class LSTMUnitLayer(Layer):
    """Bottoms c_prev (1, N, H), gate inputs x (1, N, 4H), cont (1, N); tops c, h (1, N, H)."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=3)
        self.check_tops(top, exact=2)

    def reshape(self, bottom, top):
        c_prev, x, cont = (b.shape for b in bottom)
        n = c_prev[1] if len(c_prev) == 3 else -1
        if len(c_prev) != 3 or c_prev[0] != 1 or x != (1, n, 4 * c_prev[2]) or cont != (1, n):
            raise self.error('expected c_prev (1, N, H), x (1, N, 4H) and cont (1, N), got '
                             '%s, %s and %s' % (c_prev, x, cont))
        for t in top:
            t.reshape(c_prev)

    def forward(self, bottom, top):
        n, hidden = bottom[0].shape[1:]
        c, h, self.cache = lstm_unit_forward(self.xp, bottom[1].data.reshape(n, 4 * hidden),
                                             bottom[0].data.reshape(n, hidden),
                                             bottom[2].data.reshape(n))
        top[0].data[...] = c.reshape(top[0].shape)
        top[1].data[...] = h.reshape(top[1].shape)

    def backward(self, top, propagate_down, bottom):
        n, hidden = bottom[0].shape[1:]
        dgates, dc_prev = lstm_unit_backward(self.xp, self.cache,
                                             top[0].diff.reshape(n, hidden),
                                             top[1].diff.reshape(n, hidden))
        if propagate_down[0]:
            bottom[0].diff[...] = dc_prev.reshape(bottom[0].shape)
        if propagate_down[1]:
            bottom[1].diff[...] = dgates.reshape(bottom[1].shape)

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2


class _Recurrent(Layer):
    """What LSTM and RNN share: bottoms/tops, the input projection and the carried state."""

    #: number of recurrent states (h for RNN; h, c for LSTM)
    num_states = 1
    #: gate inputs per hidden unit (4 for LSTM)
    gate_factor = 1

    def setup(self, bottom, top):
        recurrent_param = self.param.recurrent_param
        self.hidden = recurrent_param.num_output
        if self.hidden <= 0:
            raise self.error('recurrent_param.num_output must be positive')
        self.expose_hidden = recurrent_param.expose_hidden
        exposed = self.num_states if self.expose_hidden else 0
        self.check_bottoms(bottom, minimum=2 + exposed, maximum=3 + exposed)
        self.check_tops(top, exact=1 + exposed)
        self.static = len(bottom) > 2 + exposed
        self.first_state = 2 + self.static
        if bottom[0].num_axes < 2:
            raise self.error('x must be (T, N, ...), got %s' % (bottom[0].shape,))
        gates = self.gate_factor * self.hidden
        weight_filler = recurrent_param.weight_filler
        self.blobs = [self.make_blob((gates, bottom[0].count_range(2)), weight_filler),
                      self.make_blob((gates,), recurrent_param.bias_filler)]
        if self.static:
            self.blobs.append(self.make_blob((gates, bottom[2].count_range(1)), weight_filler))
        self.blobs += self.make_recurrent_params(recurrent_param)
        self.carried = None

    def reshape(self, bottom, top):
        x, cont = bottom[0], bottom[1]
        steps, num = x.shape[:2] if x.num_axes >= 2 else (-1, -1)
        if cont.shape != (steps, num):
            raise self.error('expected x (T, N, ...) and cont (T, N), got %s and %s'
                             % (x.shape, cont.shape))
        if x.count_range(2) != self.blobs[0].shape[1]:
            raise self.error('x has %d values per item, the weights expect %d'
                             % (x.count_range(2), self.blobs[0].shape[1]))
        if self.static and (bottom[2].shape[:1] != (num,) or
                            bottom[2].count_range(1) != self.blobs[2].shape[1]):
            raise self.error('static input must be (N=%d, %d values), got %s'
                             % (num, self.blobs[2].shape[1], bottom[2].shape))
        state_shape = (1, num, self.hidden)
        for b in bottom[self.first_state:]:
            if b.shape != state_shape:
                raise self.error('initial state must be %s, got %s' % (state_shape, b.shape))
        top[0].reshape(steps, num, self.hidden)
        for t in top[1:]:
            t.reshape(state_shape)

    def project_inputs(self, bottom):
        """W x_t + b (+ W_static x_static) for every step at once: (T, N, gates)."""
        steps, num = bottom[1].shape
        x = bottom[0].data.reshape(steps * num, -1)
        projected = (x @ self.blobs[0].data.T + self.blobs[1].data).reshape(steps, num, -1)
        if self.static:
            projected = projected + bottom[2].data.reshape(num, -1) @ self.blobs[2].data.T
        return projected

    def project_inputs_backward(self, bottom, propagate_down, dprojected):
        steps, num = bottom[1].shape
        flat = dprojected.reshape(steps * num, -1)
        if self.wants_param_gradient(0):
            self.blobs[0].diff += flat.T @ bottom[0].data.reshape(steps * num, -1)
        if self.wants_param_gradient(1):
            self.blobs[1].diff += flat.sum(axis=0)
        if propagate_down[0]:
            bottom[0].diff[...] = (flat @ self.blobs[0].data).reshape(bottom[0].shape)
        if self.static:
            per_item = dprojected.sum(axis=0)            # the static input feeds every step
            if self.wants_param_gradient(2):
                self.blobs[2].diff += per_item.T @ bottom[2].data.reshape(num, -1)
            if propagate_down[2]:
                bottom[2].diff[...] = (per_item @ self.blobs[2].data).reshape(bottom[2].shape)

    def initial_states(self, bottom):
        """Exposed initial states, or (as Caffe does) the final states of the last forward."""
        num = bottom[1].shape[1]
        if self.expose_hidden:
            return [b.data.reshape(num, self.hidden) for b in bottom[self.first_state:]]
        if self.carried is None or self.carried[0].shape != (num, self.hidden):
            zeros = self.xp.zeros((num, self.hidden), self.dtype)
            return [zeros] * self.num_states
        return self.carried

    def finish_forward(self, top, final_states):
        if self.expose_hidden:
            for t, state in zip(top[1:], final_states):
                t.data[...] = state[None]
        else:
            self.carried = [s.copy() for s in final_states]

    def final_state_diffs(self, top, num):
        if self.expose_hidden:
            return [t.diff.reshape(num, self.hidden) for t in top[1:]]
        return [self.xp.zeros((num, self.hidden), self.dtype)] * self.num_states

    def initial_state_backward(self, bottom, propagate_down, state_diffs):
        if self.expose_hidden:
            for i, d in enumerate(state_diffs, self.first_state):
                if propagate_down[i]:
                    bottom[i].diff[...] = d[None]

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1


@register('LSTM')
class LSTMLayer(_Recurrent):
    num_states = 2
    gate_factor = 4

    def make_recurrent_params(self, recurrent_param):
        return [self.make_blob((4 * self.hidden, self.hidden), recurrent_param.weight_filler)]

    def forward(self, bottom, top):
        xp = self.xp
        cont = bottom[1].data
        w_hc = self.blobs[-1].data
        projected = self.project_inputs(bottom)
        h, c = self.initial_states(bottom)
        output = xp.empty(top[0].shape, self.dtype)
        self.conted = xp.empty(top[0].shape, self.dtype)
        self.caches = []
        for t in range(cont.shape[0]):
            self.conted[t] = cont[t][:, None] * h          # cont 0 forgets the previous h
            c, h, cache = lstm_unit_forward(xp, projected[t] + self.conted[t] @ w_hc.T,
                                            c, cont[t])
            self.caches.append(cache)
            output[t] = h
        top[0].data[...] = output
        self.finish_forward(top, [h, c])

    def backward(self, top, propagate_down, bottom):
        xp = self.xp
        cont = bottom[1].data
        steps, num = cont.shape
        w_hc = self.blobs[-1].data
        dh_next, dc = self.final_state_diffs(top, num)
        dgates = xp.empty((steps, num, 4 * self.hidden), self.dtype)
        for t in reversed(range(steps)):
            dgates[t], dc = lstm_unit_backward(xp, self.caches[t], dc, top[0].diff[t] + dh_next)
            dh_next = cont[t][:, None] * (dgates[t] @ w_hc)
        if self.wants_param_gradient(len(self.blobs) - 1):
            self.blobs[-1].diff += (dgates.reshape(steps * num, -1).T @
                                    self.conted.reshape(steps * num, -1))
        self.project_inputs_backward(bottom, propagate_down, dgates)
        self.initial_state_backward(bottom, propagate_down, [dh_next, dc])


@register('RNN')
class RNNLayer(_Recurrent):
    """h_t = tanh(W_hh (cont_t h_{t-1}) + W_xh x_t + b_h);  o_t = tanh(W_ho h_t + b_o)."""

    def make_recurrent_params(self, recurrent_param):
        square = (self.hidden, self.hidden)
        return [self.make_blob(square, recurrent_param.weight_filler),
                self.make_blob(square, recurrent_param.weight_filler),
                self.make_blob((self.hidden,), recurrent_param.bias_filler)]

    def forward(self, bottom, top):
        xp = self.xp
        cont = bottom[1].data
        steps, num = cont.shape
        w_hh, w_ho, b_o = (b.data for b in self.blobs[-3:])
        projected = self.project_inputs(bottom)
        (h,) = self.initial_states(bottom)
        self.hiddens = xp.empty(top[0].shape, self.dtype)
        self.conted = xp.empty(top[0].shape, self.dtype)
        for t in range(steps):
            self.conted[t] = cont[t][:, None] * h
            h = xp.tanh(projected[t] + self.conted[t] @ w_hh.T)
            self.hiddens[t] = h
        flat = self.hiddens.reshape(steps * num, -1)
        self.output = xp.tanh(flat @ w_ho.T + b_o).reshape(top[0].shape)
        top[0].data[...] = self.output
        self.finish_forward(top, [h])

    def backward(self, top, propagate_down, bottom):
        xp = self.xp
        cont = bottom[1].data
        steps, num = cont.shape
        first = len(self.blobs) - 3                      # index of W_hh
        w_hh, w_ho = self.blobs[first].data, self.blobs[first + 1].data
        dout = (top[0].diff * (1 - self.output ** 2)).reshape(steps * num, -1)
        if self.wants_param_gradient(first + 1):
            self.blobs[first + 1].diff += dout.T @ self.hiddens.reshape(steps * num, -1)
        if self.wants_param_gradient(first + 2):
            self.blobs[first + 2].diff += dout.sum(axis=0)
        dh_from_output = (dout @ w_ho).reshape(steps, num, -1)
        (dh_next,) = self.final_state_diffs(top, num)
        dpre = xp.empty((steps, num, self.hidden), self.dtype)
        for t in reversed(range(steps)):
            dh = dh_from_output[t] + dh_next
            dpre[t] = dh * (1 - self.hiddens[t] ** 2)
            dh_next = cont[t][:, None] * (dpre[t] @ w_hh)
        if self.wants_param_gradient(first):
            self.blobs[first].diff += (dpre.reshape(steps * num, -1).T @
                                       self.conted.reshape(steps * num, -1))
        self.project_inputs_backward(bottom, propagate_down, dpre)
        self.initial_state_backward(bottom, propagate_down, [dh_next])
