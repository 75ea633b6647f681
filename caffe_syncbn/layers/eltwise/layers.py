"""Eltwise: the product, sum (with coefficients) or maximum of bottoms of one shape."""
import numpy as np

from ... import caffe_pb2
from ...backend.cpu_threads import blocks
from ...layer import Layer, register
from ..neuron.layers import relu, relu_gradient
from . import gpu as eltwise_gpu


@register('Eltwise')
class EltwiseLayer(Layer):
    """PROD, SUM (with optional coefficients) or MAX of bottoms of one shape. A SUM may
    absorb the ReLU after it (Layer.absorb): one pass forward, and the backward takes the
    ReLU's gradient from the output's sign."""

    OPS = caffe_pb2.EltwiseParameter
    #: the top of the ReLU this SUM absorbed, and its negative slope
    relu_top = relu_slope = None

    def setup(self, bottom, top):
        p = self.param.eltwise_param
        self.check_bottoms(bottom, minimum=2)
        self.op = p.operation
        if p.coeff and len(p.coeff) != len(bottom):
            raise self.error('%d coeff values for %d bottoms' % (len(p.coeff), len(bottom)))
        if p.coeff and self.op != self.OPS.SUM:
            raise self.error('coeff is only allowed with operation SUM')
        self.coeff = list(p.coeff) or [1.0] * len(bottom)

    def reshape(self, bottom, top):
        self.check_tops(top, exact=1)
        for b in bottom[1:]:
            if b.shape != bottom[0].shape:
                raise self.error('all bottoms need the same shape: %s vs %s'
                                 % (bottom[0].shape, b.shape))
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def absorb(self, layer, top):
        if self.op != self.OPS.SUM or self.relu_top is not None or layer.type != 'ReLU' \
                or layer.param.relu_param.negative_slope < 0:
            return False
        self.relu_top, self.relu_slope = top, float(layer.param.relu_param.negative_slope)
        return True

    def forward(self, bottom, top):
        xp = self.xp
        data = [b.data for b in bottom]
        if self.op == self.OPS.SUM and self.relu_top is not None and self.cuda_kernels \
                and len(bottom) == 2:
            eltwise_gpu.sum_relu(xp, bottom[0].data, self.coeff[0], bottom[1].data,
                                 self.coeff[1], self.relu_slope, self.relu_top.data)
            return
        if self.op == self.OPS.SUM:
            self._sum_forward(bottom, [self.relu_top] if self.relu_top is not None else top)
            return
        if self.op == self.OPS.PROD:
            result = data[0] * data[1]
            for d in data[2:]:
                result *= d
        else:
            # Caffe's order: bottom 1 wins a tie with bottom 0, later bottoms win only when larger
            first_wins = data[0] > data[1]
            result = xp.where(first_wins, data[0], data[1])
            self.argmax = (~first_wins).astype(np.int32)
            for k, d in enumerate(data[2:], start=2):
                larger = d > result
                result = xp.where(larger, d, result)
                self.argmax = xp.where(larger, k, self.argmax)
        top[0].data[...] = result

    def _sum_forward(self, bottom, top):
        """top = sum of coeff * bottom, block by block into the top; a bottom that is the
        top (in place) goes first, before the top is written."""
        xp = self.xp
        terms = sorted(zip(self.coeff, bottom), key=lambda term: term[1] is not top[0])
        out = top[0].data.reshape(-1)
        flat = [(c, b.data.reshape(-1)) for c, b in terms]

        def work(a, b):
            block = out[a:b]
            (c0, x0), (c1, x1) = flat[0], flat[1]
            if c0 == 1 and c1 == 1:
                xp.add(x0[a:b], x1[a:b], out=block)
            else:
                xp.multiply(x0[a:b], c0, out=block)
                block += x1[a:b] * c1 if c1 != 1 else x1[a:b]
            for c, x in flat[2:]:
                block += x[a:b] * c if c != 1 else x[a:b]
            if self.relu_slope is not None:
                relu(xp, block, self.relu_slope, block)
        blocks(xp, out.size, 1, work)

    def _sum_backward(self, top, propagate_down, bottom):
        """bottom diff = coeff * top diff (through the absorbed ReLU), block by block; the
        one that is the top's own diff (in place) is written last in each block."""
        xp = self.xp
        out = self.relu_top if self.relu_top is not None else top[0]
        dy, y = out.diff.reshape(-1), out.data.reshape(-1)
        targets = sorted(((c, b.diff.reshape(-1), b.diff is out.diff)
                          for c, b, down in zip(self.coeff, bottom, propagate_down) if down),
                         key=lambda target: target[2])
        if self.relu_top is not None and self.cuda_kernels:
            for c, dx, _ in targets:
                eltwise_gpu.sum_relu_backward(xp, y, dy, c, self.relu_slope, dx)
            return

        def work(a, b):
            g = dy[a:b]
            if self.relu_slope is not None:       # into a new array: dy is the ReLU's top diff
                g = xp.empty_like(g)
                relu_gradient(xp, y[a:b], dy[a:b], self.relu_slope, g)
            for c, dx, in_place in targets:
                if c != 1:
                    xp.multiply(g, c, out=dx[a:b])
                elif not in_place or self.relu_slope is not None:
                    dx[a:b] = g
        blocks(xp, dy.size, 1, work)

    def rerunnable(self):
        return True

    def backward_reads(self, bottom, top):
        if self.op == self.OPS.SUM:
            return [self.relu_top] if self.relu_top is not None else []   # the ReLU's sign
        return super().backward_reads(bottom, top)

    def backward(self, top, propagate_down, bottom):
        if self.op == self.OPS.SUM:
            self._sum_backward(top, propagate_down, bottom)
            return
        p = self.param.eltwise_param
        dy = top[0].diff
        grads = []
        for i, (b, down) in enumerate(zip(bottom, propagate_down)):
            if not down:
                grads.append(None)
            elif self.op == self.OPS.PROD:
                if p.stable_prod_grad:
                    others = [o.data for j, o in enumerate(bottom) if j != i]
                    product = others[0].copy()
                    for o in others[1:]:
                        product *= o
                else:
                    product = top[0].data / b.data
                grads.append(product * dy)
            else:
                grads.append(dy * (self.argmax == i))
        # all computed before any is written: in place, bottom 0's diff is the top's
        for b, g in zip(bottom, grads):
            if g is not None:
                b.diff[...] = g
