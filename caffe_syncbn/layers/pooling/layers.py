"""Pooling (MAX, AVE, STOCHASTIC) and SPP (spatial pyramid pooling) on (N, C, H, W) blobs.
The passes are an engine's, over a Pool2d of the layer's geometry (array.py)."""
import numpy as np

from ... import caffe_pb2
from ...layer import Layer, register
from . import array, gpu, host
from .array import Pool2d


def _pool_geometry(layer, pp, in_hw):
    """kernel, stride, pad pairs from a PoolingParameter (global pooling: the whole input)."""
    if pp.global_pooling:
        if pp.HasField('kernel_size') or pp.HasField('kernel_h') or pp.HasField('kernel_w'):
            raise layer.error('global_pooling takes the whole input; do not give a kernel size')
        kernel = tuple(in_hw)
    elif pp.HasField('kernel_h') or pp.HasField('kernel_w'):
        if pp.HasField('kernel_size'):
            raise layer.error('give kernel_size or kernel_h/kernel_w, not both')
        if not (pp.HasField('kernel_h') and pp.HasField('kernel_w')):
            raise layer.error('a non-square kernel needs both kernel_h and kernel_w')
        kernel = (pp.kernel_h, pp.kernel_w)
    elif pp.HasField('kernel_size'):
        kernel = (pp.kernel_size, pp.kernel_size)
    else:
        raise layer.error('kernel_size (or kernel_h and kernel_w, or global_pooling) is required')
    pad = (pp.pad_h, pp.pad_w) if pp.HasField('pad_h') or pp.HasField('pad_w') else (pp.pad,) * 2
    if pp.HasField('stride_h') or pp.HasField('stride_w'):
        stride = (pp.stride_h, pp.stride_w)
    else:
        stride = (pp.stride,) * 2
    if pp.global_pooling and (any(pad) or stride != (1, 1)):
        raise layer.error('global_pooling needs pad 0 and stride 1, got pad %s stride %s'
                          % (pad, stride))
    return kernel, stride, pad


def _rounds_up(layer, pp):
    """Whether the pooled size rounds up, Caffe's way, or down, as each fork spells it:
    BVLC's round_mode, BVLC pull request 3057's ceil_mode (OpenCV's reader and the PyTorch
    converters' Caffe), and torch_pooling (Facebook's Caffe; NVCaffe's schema has it too).
    Settings that disagree are an error."""
    says = {}
    if pp.HasField('round_mode'):
        says['round_mode: %s' % pp.RoundMode.Name(pp.round_mode)] = pp.round_mode == pp.CEIL
    if pp.HasField('ceil_mode'):
        says['ceil_mode: %s' % str(pp.ceil_mode).lower()] = pp.ceil_mode
    if pp.HasField('torch_pooling'):
        says['torch_pooling: %s' % str(pp.torch_pooling).lower()] = not pp.torch_pooling
    if len(set(says.values())) > 1:
        raise layer.error('pooling_param rounds both ways: %s' % ', '.join(sorted(says)))
    return all(says.values())


def _require_4d(layer, blob):
    if blob.num_axes != 4:
        raise layer.error('expects a 4-axis (N, C, H, W) bottom, got shape %s' % (blob.shape,))


@register('Pooling')
class PoolingLayer(Layer):

    def full_precision_top(self, index):
        return index == 1           # MAX's mask: indices, exact to 2^24 in float32

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        pp = self.param.pooling_param
        self.method = caffe_pb2.PoolingParameter.PoolMethod.Name(pp.pool)
        self.check_tops(top, minimum=1, maximum=2 if self.method == 'MAX' else 1)
        self.pool = None
        self.rounds_up = _rounds_up(self, pp)
        # the engine, chosen once: the CUDA kernels (MAX and AVE), the host's MAX (small
        # kernels), else array code; each hands what it does not run to the array engine
        if self.cuda_kernels:
            self.engine = gpu
        elif self.xp is np:
            self.engine = host
        else:
            self.engine = array

    def reshape(self, bottom, top):
        _require_4d(self, bottom[0])
        pp = self.param.pooling_param
        in_hw = bottom[0].shape[2:]
        if self.pool is None or self.pool.in_hw != in_hw:
            kernel, stride, pad = _pool_geometry(self, pp, in_hw)
            self.pool = Pool2d(self.method, in_hw, kernel, stride, pad, self.rounds_up,
                               self.error)
        for t in top:
            t.reshape(bottom[0].shape[:2] + self.pool.out_hw)

    def forward(self, bottom, top):
        self.engine.forward(self.pool, bottom[0].data, self.phase, self.ctx.rng, top[0].data)
        if len(top) > 1:
            top[1].data[...] = self.engine.mask(self.pool)

    def backward_reads(self, bottom, top):
        return []                   # MAX keeps its mask; AVE and STOCHASTIC's TEST are linear

    def rerunnable(self):
        return self.method != 'STOCHASTIC'      # which draws its samples anew

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        try:
            self.engine.backward(self.pool, top[0].diff, self.phase, bottom[0].diff)
        except ValueError as e:
            raise self.error(str(e)) from None


@register('SPP')
class SPPLayer(Layer):
    """Pools at 1, 2, 4, ... bins per side and concatenates the flattened results."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        sp = self.param.spp_param
        self.height = sp.pyramid_height
        if self.height < 1:
            raise self.error('pyramid_height must be positive, got %d' % self.height)
        self.method = caffe_pb2.SPPParameter.PoolMethod.Name(sp.pool)
        self.levels = []
        self.engine = host if self.xp is np else array

    def reshape(self, bottom, top):
        _require_4d(self, bottom[0])
        in_hw = bottom[0].shape[2:]
        n, c = bottom[0].shape[:2]
        if not (self.levels and self.levels[0].in_hw == in_hw):
            self.levels = self._pyramid(in_hw)
        if self.height == 1:       # Caffe then gives the pooling top itself, 4-D
            top[0].reshape((n, c) + self.levels[0].out_hw)
        else:
            top[0].reshape(n, sum(c * int(np.prod(p.out_hw)) for p in self.levels))

    def _pyramid(self, in_hw):
        levels = []
        for level in range(self.height):
            bins = 2 ** level
            kernel = tuple(-(-size // bins) for size in in_hw)
            pad = tuple((k * bins - size + 1) // 2 for k, size in zip(kernel, in_hw))
            levels.append(Pool2d(self.method, in_hw, kernel, kernel, pad, True, self.error))
        return levels

    def forward(self, bottom, top):
        x = bottom[0].data
        pooled = []
        for p in self.levels:
            out = self.xp.empty(x.shape[:2] + p.out_hw, x.dtype)
            self.engine.forward(p, x, self.phase, self.ctx.rng, out)
            pooled.append(out.reshape(x.shape[0], -1))
        top[0].data[...] = self.xp.concatenate(pooled, axis=1).reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        n, c = bottom[0].shape[:2]
        dy = top[0].diff.reshape(n, -1)
        dx = None
        start = 0
        for p in self.levels:
            count = c * int(np.prod(p.out_hw))
            part = dy[:, start:start + count].reshape((n, c) + p.out_hw)
            start += count
            grad = self.xp.empty((n, c) + p.in_hw, part.dtype)
            try:
                self.engine.backward(p, part, self.phase, grad)
            except ValueError as e:
                raise self.error(str(e)) from None
            dx = grad if dx is None else dx + grad
        bottom[0].diff[...] = dx
