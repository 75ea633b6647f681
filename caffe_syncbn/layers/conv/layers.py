"""Convolution, Deconvolution and Im2col layers (N-D, grouped, dilated).

A convolution is im2col + GEMM. On numpy, Convolution runs chunk by chunk in conv_cpu.py,
depthwise ones (and depthwise Deconvolutions) in depthwise_cpu.py, and 3x3 stride-1 ones
whose shape pays for it with Winograd's F(2x2, 3x3) in winograd_cpu.py (``engine: CAFFE``
keeps im2col). Elsewhere (CuPy), and for other Deconvolutions, columns are laid out
``(N, G, C/G * K, P)`` (image, group, channel-and-kernel-offset, output position) and the
weights ``(G, O/G, C/G * K)``; 1x1 stride-1 unpadded kernels use the image itself as its
columns.
"""
import math
import numpy as np

from ...backend import cpu_threads
from ...layer import Layer, register
from ..shape.layers import canonical_axis
from . import array as im2col_module, gpu as conv_gpu, host as conv_cpu, \
    host_depthwise as depthwise_cpu, host_winograd as winograd_cpu
from .array import conv_output_shape

# Below this many output positions per image, per-image GEMMs are too thin to run at
# full speed, so the batch is folded into the GEMM's columns (at the cost of a transpose).
_WIDE_IMAGE = 1024


def _per_image(n, p):
    return n == 1 or p >= _WIDE_IMAGE


def grouped_matmul(w, x, out=None):
    """``y[n, g] = w[g] @ x[n, g]``: w ``(G, M, K)``, x ``(N, G, K, P)`` -> ``(N, G, M, P)``.

    ``out`` (optional, not overlapping x) receives the result.
    """
    n, g, k, p = x.shape
    if _per_image(n, p):
        return cpu_threads.batched_matmul(w, x, out=out)
    folded = x.transpose(1, 2, 0, 3).reshape(g, k, n * p)
    y = cpu_threads.batched_matmul(w, folded).reshape(g, w.shape[1], n, p).transpose(2, 0, 1, 3)
    if out is None:
        return y
    out[...] = y
    return out


def grouped_outer(a, b):
    """``sum_n a[n, g] @ b[n, g].T``: a ``(N, G, M, P)``, b ``(N, G, K, P)`` -> ``(G, M, K)``."""
    n, g, m, p = a.shape
    if n == 1:
        return cpu_threads.batched_matmul(a[0], b[0].swapaxes(1, 2))
    if p >= _WIDE_IMAGE and n <= 4:     # a few per-image products, summed
        return cpu_threads.batched_matmul(a, b.swapaxes(2, 3)).sum(axis=0)
    fold_a = a.transpose(1, 2, 0, 3).reshape(g, m, n * p)
    fold_b = b.transpose(1, 2, 0, 3).reshape(g, b.shape[2], n * p)
    return cpu_threads.batched_matmul(fold_a, fold_b.swapaxes(1, 2))


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
        # the engine, chosen once: im2col by the CUDA kernels (2-D), or as array code; and
        # whether the host's blocked GEMMs of conv_cpu run the layer
        self.im2col = conv_gpu if self.cuda_kernels and self.num_spatial == 2 else im2col_module
        self.host = self.xp is np and not self.cuda_kernels

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

    def _image(self, array, channels, spatial):
        return array.reshape((self.batch, channels) + tuple(spatial))

    def _columns(self, image):
        """im2col of ``image`` ``(N, C, *spatial)``; a view of it for 1x1 kernels."""
        if self.pointwise:
            return image
        try:
            return self.im2col.im2col(image, self.kernel, self.pad, self.stride,
                                                self.dilation)
        except ValueError as e:
            raise self.error(str(e)) from None

    def _image_from_columns(self, col, spatial):
        if self.pointwise:
            return col
        return self.im2col.col2im(col, spatial, self.kernel, self.pad, self.stride,
                                            self.dilation)


class _ConvolutionBase(_SpatialLayer):
    """Learnable (de)convolution: weights, bias, groups, several bottom/top pairs."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=1)
        if len(top) != len(bottom):
            raise self.error('needs one top per bottom, got %d bottoms and %d tops'
                             % (len(bottom), len(top)))
        self._setup_geometry(bottom)
        cp = self.param.convolution_param
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
        # on the host, a depthwise (de)convolution runs its own shifted passes (depthwise_cpu);
        # a 3x3 stride-1 one may run Winograd's (winograd_cpu), where its shape pays for it
        self.depthwise = self.host and depthwise_cpu.applies(self)
        self.winograd = self.host and not self.depthwise and winograd_cpu.applies(self)

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

    def _grouped(self, array, positions):
        """``(N, G, rows, positions)`` view of a per-image matrix stack (N may be 0)."""
        per_image = array.size // self.batch if self.batch else int(math.prod(array.shape[1:]))
        rows = per_image // (self.group * positions)
        return array.reshape(self.batch, self.group, rows, positions)

    def _add_bias(self, out):
        if self.bias_term:
            out += self.blobs[1].data.reshape(-1, 1)

    def _accumulate_bias_grad(self, top_diff):
        """``top_diff`` as ``(N, num_output, positions)``."""
        if self.bias_term and self.wants_param_gradient(1):
            self.blobs[1].diff += top_diff.sum(axis=(0, 2))

    def _accumulate_weight_grad(self, left, right):
        """Both grouped ``(N, G, rows, positions)``; their products summed over the batch."""
        self.blobs[0].diff += grouped_outer(left, right).reshape(self.blobs[0].shape)


@register('Convolution')
class ConvolutionLayer(_ConvolutionBase):
    transposed = False

    def _grouped_columns(self, data):
        col = self._columns(self._image(data, self.channels, self.in_spatial))
        return self._grouped(col, int(math.prod(self.out_spatial)))

    def forward(self, bottom, top):
        weight = self.grouped_weight()
        positions = int(math.prod(self.out_spatial))
        for b, t in zip(bottom, top):
            if self.host:       # in place, the input must outlive the first written output
                self._host_forward(b.data.copy() if t is b else b.data, t.data)
                continue
            col = self._grouped_columns(b.data)
            if t is b and self.pointwise:     # in place, and the columns are the input
                col = col.copy()
            grouped_matmul(weight, col, out=self._grouped(t.data, positions))
            self._add_bias(t.data.reshape(self.batch, self.num_output, positions))

    def backward_reads(self, bottom, top):
        return list(bottom)         # the weight gradient reads the input

    def backward(self, top, propagate_down, bottom):
        weight = self.grouped_weight()
        positions = int(math.prod(self.out_spatial))
        weight_grad = self.blobs[0].diff.reshape(weight.shape) \
            if self.wants_param_gradient(0) else None
        for i, (t, b) in enumerate(zip(top, bottom)):
            dy = t.diff.reshape(self.batch, self.num_output, positions)
            self._accumulate_bias_grad(dy)
            if self.host:
                dx = b.diff if propagate_down[i] else None
                self._host_backward(b.data, dy.copy() if t is b and dx is not None else dy, dx,
                                    weight_grad)
                continue
            grouped_dy = self._grouped(dy, positions)
            if weight_grad is not None:
                self._accumulate_weight_grad(grouped_dy, self._grouped_columns(b.data))
            if propagate_down[i]:
                dcol = grouped_matmul(weight.swapaxes(1, 2), grouped_dy)
                dcol = dcol.reshape((self.batch, self.channels) + self.kernel + self.out_spatial)
                dx = self._image_from_columns(dcol, self.in_spatial)
                b.diff[...] = dx.reshape(b.shape)

    def _matrices(self, array, rows):
        """``array`` as (N, rows, positions): a 1x1 convolution's input is its own columns."""
        return array.reshape(self.batch, rows, int(math.prod(self.in_spatial)))

    def host_engine(self):
        """The module that runs this (not 1x1) convolution on the host, at this shape."""
        if self.depthwise:
            return depthwise_cpu
        if self.winograd and winograd_cpu.pays(self):
            return winograd_cpu
        return conv_cpu

    def _host_forward(self, x, y):
        y3 = y.reshape(self.batch, self.num_output, int(math.prod(self.out_spatial)))
        if self.pointwise:
            conv_cpu.pointwise_forward(self, self._matrices(x, self.channels), y3)
        else:
            self.host_engine().forward(self, self._image(x, self.channels, self.in_spatial), y3)

    def _host_backward(self, x, dy, dx, weight_grad):
        if self.pointwise:
            conv_cpu.pointwise_backward(self, self._matrices(x, self.channels), dy,
                                        None if dx is None else
                                        self._matrices(dx, self.channels), weight_grad)
            return
        self.host_engine().backward(
            self, self._image(x, self.channels, self.in_spatial), dy,
            None if dx is None else self._image(dx, self.channels, self.in_spatial), weight_grad)


@register('Deconvolution')
class DeconvolutionLayer(_ConvolutionBase):
    """The adjoint of Convolution: its forward is Convolution's data gradient."""
    transposed = True

    def forward(self, bottom, top):
        weight = self.grouped_weight()
        positions = int(math.prod(self.in_spatial))
        for b, t in zip(bottom, top):
            out = t.data.reshape(self.batch, self.num_output, int(math.prod(self.out_spatial)))
            if self.depthwise:
                depthwise_cpu.forward(self, self._image(b.data, self.channels, self.in_spatial),
                                      out)
                continue
            x = self._grouped(b.data, positions)
            col = grouped_matmul(weight.swapaxes(1, 2), x)
            col = col.reshape((self.batch, self.num_output) + self.kernel + self.in_spatial)
            y = self._image_from_columns(col, self.out_spatial)
            out[...] = y.reshape(out.shape)
            self._add_bias(out)

    def backward(self, top, propagate_down, bottom):
        weight = self.grouped_weight()
        positions = int(math.prod(self.in_spatial))
        for i, (t, b) in enumerate(zip(top, bottom)):
            dy = t.diff.reshape(self.batch, self.num_output, int(math.prod(self.out_spatial)))
            self._accumulate_bias_grad(dy)
            if not (self.wants_param_gradient(0) or propagate_down[i]):
                continue
            if self.depthwise:
                dx = self._image(b.diff, self.channels, self.in_spatial) \
                    if propagate_down[i] else None
                depthwise_cpu.backward(
                    self, self._image(b.data, self.channels, self.in_spatial), dy, dx,
                    self.blobs[0].diff if self.wants_param_gradient(0) else None)
                continue
            col = self._columns(self._image(dy, self.num_output, self.out_spatial))
            col = self._grouped(col, positions)
            if self.wants_param_gradient(0):
                self._accumulate_weight_grad(self._grouped(b.data, positions), col)
            if propagate_down[i]:
                b.diff[...] = grouped_matmul(weight, col).reshape(b.shape)


@register('Im2col')
class Im2colLayer(_SpatialLayer):
    """The columns themselves: channels become (channel, kernel offsets)."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        self._setup_geometry(bottom)

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
        col = self._columns(self._image(bottom[0].data, self.channels, self.in_spatial))
        top[0].data[...] = col.reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        col = top[0].diff.reshape((self.batch, self.channels) + self.kernel + self.out_spatial)
        bottom[0].diff[...] = self._image_from_columns(col, self.in_spatial).reshape(
            bottom[0].shape)
