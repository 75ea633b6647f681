"""The PSPNet fork's Interp layer: crop, then align-corners bilinear resize.

Negative pad_beg/pad_end crop the input (the same amounts on H and W).  The sampling
positions are computed in float32, as the fork does, so outputs match it bit for bit
on float32 data.  Forward interpolates along W, then along H (the fork's order of
operations); backward is the exact adjoint, as small dense interpolation matrices.
"""
import numpy as np

from ...backend.cpu_threads import blocks
from ...layer import Layer, register
from . import gpu as interp_gpu


def interp_taps(in_size, out_size):
    """Per output index: the two source indices and their weights (float32), aligned corners."""
    ratio = (np.float32(in_size - 1) / np.float32(out_size - 1)) if out_size > 1 \
        else np.float32(0)
    source = ratio * np.arange(out_size, dtype=np.float32)
    first = source.astype(np.int64)
    second = np.minimum(first + 1, in_size - 1)
    weight_second = source - first.astype(np.float32)
    return first, second, weight_second


def interp_matrix(in_size, out_size, dtype):
    """The (out, in) matrix of the 1-D resize."""
    first, second, weight_second = interp_taps(in_size, out_size)
    weight_second = weight_second.astype(dtype)
    matrix = np.zeros((out_size, in_size), dtype)
    rows = np.arange(out_size)
    np.add.at(matrix, (rows, first), 1 - weight_second)
    np.add.at(matrix, (rows, second), weight_second)
    return matrix


@register('Interp')
class InterpLayer(Layer):

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        ip = self.param.interp_param
        if ip.pad_beg > 0 or ip.pad_end > 0:
            raise self.error('pad_beg and pad_end must be <= 0 (they crop), got %d and %d'
                             % (ip.pad_beg, ip.pad_end))
        self.crop_begin = -ip.pad_beg
        self.out_hw = self._taps = self._taps_for = None
        # the engine, chosen once: the CUDA kernels (float32, float64), else array code
        self.kernels = interp_gpu if self.cuda_kernels and interp_gpu.supports(self.dtype) \
            else None

    def _out_size(self, ip, height, width):
        """The fork's size rules, chosen by which fields are present, in its order."""
        has_shrink, has_zoom = ip.HasField('shrink_factor'), ip.HasField('zoom_factor')
        for name, present in (('shrink_factor', has_shrink), ('zoom_factor', has_zoom)):
            if present and getattr(ip, name) < 1:
                raise self.error('%s must be >= 1, got %d' % (name, getattr(ip, name)))

        def shrink(size):
            return (size - 1) // ip.shrink_factor + 1

        def zoom(size):
            return size + (size - 1) * (ip.zoom_factor - 1)

        if has_shrink and not has_zoom:
            return shrink(height), shrink(width)
        if has_zoom and not has_shrink:
            return zoom(height), zoom(width)
        if ip.HasField('height') and ip.HasField('width'):
            return ip.height, ip.width
        if has_shrink and has_zoom:
            return zoom(shrink(height)), zoom(shrink(width))
        raise self.error('give shrink_factor and/or zoom_factor, or both height and width')

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error('expects a 4-axis (N, C, H, W) bottom, got shape %s'
                             % (bottom[0].shape,))
        ip = self.param.interp_param
        n, c, height, width = bottom[0].shape
        crop = ip.pad_beg + ip.pad_end
        self.in_hw = (height + crop, width + crop)
        if min(self.in_hw) < 1:
            raise self.error('cropping pad_beg %d pad_end %d leaves nothing of the %dx%d input'
                             % (ip.pad_beg, ip.pad_end, height, width))
        out_hw = tuple(int(s) for s in self._out_size(ip, *self.in_hw))
        if min(out_hw) < 1:
            raise self.error('output size %s must be positive' % (out_hw,))
        if out_hw != self.out_hw or self._taps is None or self._taps_for != self.in_hw:
            self.out_hw, self._taps_for = out_hw, self.in_hw
            self._taps = [self._device_taps(i, o) for i, o in zip(self.in_hw, out_hw)]
            self._matrices = None       # built on the first backward
        self.copy_only = self.out_hw == self.in_hw
        top[0].reshape(n, c, *self.out_hw)

    def _device_taps(self, in_size, out_size):
        first, second, weight = interp_taps(in_size, out_size)
        weight = weight.astype(self.dtype)
        xp = self.xp
        return xp.asarray(first), xp.asarray(second), xp.asarray(1 - weight), xp.asarray(weight)

    def _cropped(self, array):
        b = self.crop_begin
        return array[:, :, b:b + self.in_hw[0], b:b + self.in_hw[1]]

    def forward(self, bottom, top):
        if self.kernels is not None and not self.copy_only:   # a pure crop is one copy
            self.kernels.forward(self, bottom, top)
            return
        x = self._cropped(bottom[0].data)
        if self.copy_only:
            top[0].data[...] = x
            return
        (h_first, h_second, h_w0, h_w1), (w_first, w_second, w_w0, w_w1) = self._taps
        planes = x.reshape((-1,) + x.shape[2:])
        out = top[0].data.reshape((-1,) + self.out_hw)

        # a block of channel planes at a time, with the same products and sums as the
        # fork: no temporary of the top's size
        def work(p0, p1):
            source = planes[p0:p1]
            along_w = w_w0 * source[:, :, w_first] + w_w1 * source[:, :, w_second]
            block = out[p0:p1]
            self.xp.multiply(h_w0[:, None], along_w[:, h_first], out=block)
            block += h_w1[:, None] * along_w[:, h_second]
        blocks(self.xp, planes.shape[0], out[0].size if len(out) else 1, work,
               out.dtype.itemsize)

    def backward_reads(self, bottom, top):
        return []                   # linear in its input

    def rerunnable(self):
        return True

    def backward(self, top, propagate_down, bottom):
        if self.kernels is not None and not self.copy_only:
            self.kernels.backward(self, top, propagate_down, bottom)
            return
        if not propagate_down[0]:
            return
        dy = top[0].diff
        if self.copy_only:
            grad = dy.copy()        # dy may be the bottom's diff when run in place
        else:
            if self._matrices is None:
                self._matrices = [self.xp.asarray(interp_matrix(i, o, self.dtype))
                                  for i, o in zip(self.in_hw, self.out_hw)]
            along_h, along_w = self._matrices
            grad = along_h.T @ (dy @ along_w)
        dx = bottom[0].diff
        dx[...] = 0
        self._cropped(dx)[...] = grad
