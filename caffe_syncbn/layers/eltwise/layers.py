"""Eltwise: the product, sum (with coefficients) or maximum of bottoms of one shape. A SUM's
passes are an engine's: array code (array.py) or, for the SUM + ReLU chain, the CUDA kernels
(gpu.py)."""
import numpy as np

from ... import caffe_pb2
from ...layer import Layer, register
from . import array, gpu


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
        self.engine = gpu if self.cuda_kernels else array

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

    def _sum_output(self, top):
        """What a SUM writes: the top of the ReLU it absorbed, else its own."""
        return [self.relu_top] if self.relu_top is not None else top

    def forward(self, bottom, top):
        if self.op == self.OPS.SUM:
            self.engine.sum_forward(self, bottom, self._sum_output(top))
            return
        xp = self.xp
        data = [b.data for b in bottom]
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

    def rerunnable(self):
        return True

    def backward_reads(self, bottom, top):
        if self.op == self.OPS.SUM:
            return [self.relu_top] if self.relu_top is not None else []   # the ReLU's sign
        return super().backward_reads(bottom, top)

    def backward(self, top, propagate_down, bottom):
        if self.op == self.OPS.SUM:
            self.engine.sum_backward(self, self._sum_output(top), propagate_down, bottom)
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
