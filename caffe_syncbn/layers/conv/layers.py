"""Convolution, Deconvolution and Im2col layers (N-D, grouped, dilated).

A convolution is im2col + GEMM. The passes are an engine's, chosen once in setup as
Caffe's layer factory picks CUDNN or CAFFE: on numpy the host's (host.py: chunked GEMMs,
depthwise passes, Winograd), with the CUDA kernels the im2col of cuda/conv.cu (gpu.py, 2-D),
or cuDNN's graphs where ``CAFFE_SYNCBN_CUDNN=1`` asks for them and ``engine: CAFFE`` does
not refuse them (gpu_cudnn.py), elsewhere array code (array.py), which states the passes
every engine has.
"""
import math
import numpy as np

from ...layer import Layer, register
from ..shape.layers import canonical_axis
from . import array, gpu, gpu_cudnn, host, host_depthwise, host_winograd
from .array import conv_output_shape


def conv_geometry(layer, cp, num_spatial):
    """(kernel, stride, pad, dilation) tuples, one value per spatial axis, from ``cp``."""
    def per_axis(values, default, what):
        values = tuple(int(v) for v in values)
        if not values:
            return (default,) * num_spatial
        if len(values) in (1, num_spatial):
            return values * (num_spatial // len(values))
        raise layer.error('%s has %d values; give 1 or %d (one per spatial axis)'
                          % (what, len(values), num_spatial))

    def pair(what, repeated):
        h, w = what + '_h', what + '_w'
        if not (cp.HasField(h) or cp.HasField(w)):
            return None
        if num_spatial != 2:
            raise layer.error('%s/%s are for 2-D convolution only; this one has %d spatial axes'
                              % (h, w, num_spatial))
        if len(repeated):
            raise layer.error('give %s or %s/%s, not both' % (
                'kernel_size' if what == 'kernel' else what, h, w))
        if what != 'pad' and not (cp.HasField(h) and cp.HasField(w)):
            raise layer.error('%s needs both %s and %s' % (what, h, w))
        return (getattr(cp, h), getattr(cp, w))

    kernel = pair('kernel', cp.kernel_size)
    if kernel is None:
        if not len(cp.kernel_size):
            raise layer.error('kernel_size (or kernel_h and kernel_w) is required')
        kernel = per_axis(cp.kernel_size, None, 'kernel_size')
    stride = pair('stride', cp.stride) or per_axis(cp.stride, 1, 'stride')
    pad = pair('pad', cp.pad) or per_axis(cp.pad, 0, 'pad')
    dilation = per_axis(cp.dilation, 1, 'dilation')
    for what, values in (('kernel size', kernel), ('stride', stride), ('dilation', dilation)):
        if min(values) < 1:
            raise layer.error('%s must be positive, got %s' % (what, values))
    return kernel, stride, pad, dilation


class _SpatialLayer(Layer):
    """What Convolution, Deconvolution and Im2col share: the channel axis and geometry."""

    def _setup_geometry(self, bottom):
        cp = self.param.convolution_param
        self.axis = canonical_axis(self, bottom[0], cp.axis)
        self.num_spatial = bottom[0].num_axes - self.axis - 1
        if self.num_spatial < 1:
            raise self.error('needs spatial axes after the channel axis %d; bottom shape %s'
                             % (self.axis, bottom[0].shape))
        self.kernel, self.stride, self.pad, self.dilation = conv_geometry(
            self, cp, self.num_spatial)
        self.channels = bottom[0].shape[self.axis]
        self.pointwise = (all(k == 1 for k in self.kernel) and all(s == 1 for s in self.stride)
                          and not any(self.pad))
        self.kernel_count = int(math.prod(self.kernel))
        if self.cuda_kernels and self.num_spatial == 2:
            self.engine = gpu
        elif self.xp is np and not self.cuda_kernels:
            self.engine = host
        else:
            self.engine = array

    def _reshape_input(self, bottom):
        shape = bottom[0].shape
        for b in bottom[1:]:
            if b.shape != shape:
                raise self.error('all bottoms must have the same shape; got %s and %s'
                                 % (shape, b.shape))
        if len(shape) != self.axis + 1 + self.num_spatial or shape[self.axis] != self.channels:
            raise self.error('bottom shape %s does not fit this layer, set up for %d channels '
                             'on axis %d with %d spatial axes'
                             % (shape, self.channels, self.axis, self.num_spatial))
        self.batch = int(math.prod(shape[:self.axis]))
        self.in_spatial = tuple(shape[self.axis + 1:])

    def image(self, data, channels, spatial):
        """``data`` as (N, channels, *spatial) images."""
        return data.reshape((self.batch, channels) + tuple(spatial))


class _ConvolutionBase(_SpatialLayer):
    """Learnable (de)convolution: weights, bias, groups, several bottom/top pairs."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=1)
        if len(top) != len(bottom):
            raise self.error('needs one top per bottom, got %d bottoms and %d tops'
                             % (len(bottom), len(top)))
        self._setup_geometry(bottom)
        cp = self.param.convolution_param
        if (self.cuda_kernels and self.xp is not np and cp.engine != cp.CAFFE
                and gpu_cudnn.chosen(self.num_spatial, self.ctx.dtype)):
            self.engine = gpu_cudnn
        self.num_output = cp.num_output
        self.group = cp.group
        if self.num_output < 1:
            raise self.error('num_output must be positive, got %d' % self.num_output)
        if self.group < 1 or self.channels % self.group or self.num_output % self.group:
            raise self.error('group %d must divide the input channels (%d) and num_output (%d)'
                             % (self.group, self.channels, self.num_output))
        first, second = self.channels, self.num_output
        if self.transposed:
            first, second = second, first
        # Caffe's weight shape: (outputs, inputs / group, *kernel) of the underlying conv
        self.blobs = [self.make_blob((second, first // self.group) + self.kernel,
                                     cp.weight_filler)]
        self.bias_term = cp.bias_term
        if self.bias_term:
            self.blobs.append(self.make_blob((self.num_output,), cp.bias_filler))
        # on the host, a depthwise (de)convolution runs its own shifted passes; a 3x3
        # stride-1 one may run Winograd's, where its shape pays for it (host.py)
        self.depthwise = self.engine is host and host_depthwise.applies(self)
        self.winograd = self.engine is host and not self.depthwise and host_winograd.applies(self)

    def reshape(self, bottom, top):
        self._reshape_input(bottom)
        if self.transposed:
            self.out_spatial = tuple(s * (i - 1) + d * (k - 1) + 1 - 2 * p for i, k, p, s, d in
                                     zip(self.in_spatial, self.kernel, self.pad, self.stride,
                                         self.dilation))
        else:
            self.out_spatial = conv_output_shape(self.in_spatial, self.kernel, self.pad,
                                                 self.stride, self.dilation)
        if min(self.out_spatial) < 1:
            raise self.error('output would be empty: input spatial shape %s, kernel %s, pad %s, '
                             'stride %s, dilation %s' % (self.in_spatial, self.kernel, self.pad,
                                                         self.stride, self.dilation))
        shape = bottom[0].shape[:self.axis] + (self.num_output,) + self.out_spatial
        for t in top:
            t.reshape(shape)

    def grouped_weight(self):
        """The weights as ``(G, rows, cols)`` matrices of the underlying convolution."""
        w = self.blobs[0].data
        return w.reshape(self.group, w.shape[0] // self.group, -1)

    def _accumulate_bias_grad(self, top_diff):
        """``top_diff`` as ``(N, num_output, positions)``."""
        if self.bias_term and self.wants_param_gradient(1):
            self.blobs[1].diff += top_diff.sum(axis=(0, 2))

    def forward(self, bottom, top):
        outputs = int(math.prod(self.out_spatial))
        for b, t in zip(bottom, top):
            # in place, the input must outlive the first written output
            x = self.image(b.data.copy() if t is b else b.data, self.channels, self.in_spatial)
            self.engine.forward(self, x, t.data.reshape(self.batch, self.num_output, outputs))

    def backward(self, top, propagate_down, bottom):
        outputs = int(math.prod(self.out_spatial))
        weight_grad = self.blobs[0].diff.reshape(self.grouped_weight().shape) \
            if self.wants_param_gradient(0) else None
        for i, (t, b) in enumerate(zip(top, bottom)):
            dy = t.diff.reshape(self.batch, self.num_output, outputs)
            self._accumulate_bias_grad(dy)
            dx = self.image(b.diff, self.channels, self.in_spatial) if propagate_down[i] \
                else None
            if dx is None and weight_grad is None:
                continue
            self.engine.backward(self, self.image(b.data, self.channels, self.in_spatial),
                                 dy.copy() if t is b and dx is not None else dy, dx, weight_grad)


@register('Convolution')
class ConvolutionLayer(_ConvolutionBase):
    transposed = False

    def backward_reads(self, bottom, top):
        return list(bottom)         # the weight gradient reads the input


@register('Deconvolution')
class DeconvolutionLayer(_ConvolutionBase):
    """The adjoint of Convolution: its forward is Convolution's data gradient."""
    transposed = True


@register('Im2col')
class Im2colLayer(_SpatialLayer):
    """The columns themselves: channels become (channel, kernel offsets)."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        self._setup_geometry(bottom)
        if self.engine is host:     # the host engine makes no columns of its own
            self.engine = array

    def reshape(self, bottom, top):
        self._reshape_input(bottom)
        self.out_spatial = conv_output_shape(self.in_spatial, self.kernel, self.pad, self.stride,
                                             self.dilation)
        if min(self.out_spatial) < 1:
            raise self.error('kernel %s (pad %s, dilation %s) does not fit the input %s'
                             % (self.kernel, self.pad, self.dilation, self.in_spatial))
        top[0].reshape(bottom[0].shape[:self.axis] + (self.channels * self.kernel_count,)
                       + self.out_spatial)

    def forward(self, bottom, top):
        image = self.image(bottom[0].data, self.channels, self.in_spatial)
        if self.pointwise:
            top[0].data[...] = image.reshape(top[0].shape)
            return
        try:
            col = self.engine.im2col(image, self.kernel, self.pad, self.stride, self.dilation)
        except ValueError as e:
            raise self.error(str(e)) from None
        top[0].data[...] = col.reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        col = top[0].diff.reshape((self.batch, self.channels) + self.kernel + self.out_spatial)
        if not self.pointwise:
            col = self.engine.col2im(col, self.in_spatial, self.kernel, self.pad, self.stride,
                                     self.dilation)
        bottom[0].diff[...] = col.reshape(bottom[0].shape)
