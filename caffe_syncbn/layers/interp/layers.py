"""The PSPNet fork's Interp layer: crop, then align-corners bilinear resize.

Negative pad_beg/pad_end crop the input (the same amounts on H and W).  The sampling
positions are computed in float32, as the fork does, so outputs match it bit for bit
on float32 data. The passes are an engine's: the CUDA kernels (gpu.py) or array code
(array.py).
"""
from ...layer import Layer, register
from . import array, gpu


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
        self.out_hw = self._sizes_for = None
        #: what the array engine builds once per pair of sizes: its taps and matrices
        self.taps = self.matrices = None
        self.engine = gpu if self.cuda_kernels and gpu.supports(bottom[0].dtype) else array

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
        if (self.in_hw, out_hw) != self._sizes_for:
            self.out_hw, self._sizes_for = out_hw, (self.in_hw, out_hw)
            self.taps = self.matrices = None
        self.copy_only = self.out_hw == self.in_hw
        top[0].reshape(n, c, *self.out_hw)

    def cropped(self, array):
        """The part of an (N, C, H, W) array that the crop keeps."""
        b = self.crop_begin
        return array[:, :, b:b + self.in_hw[0], b:b + self.in_hw[1]]

    def forward(self, bottom, top):
        if self.copy_only:          # a pure crop is one copy, whatever the engine
            top[0].data[...] = self.cropped(bottom[0].data)
        else:
            self.engine.forward(self, bottom, top)

    def backward_reads(self, bottom, top):
        return []                   # linear in its input

    def rerunnable(self):
        return True

    def backward(self, top, propagate_down, bottom):
        if not self.copy_only:
            self.engine.backward(self, top, propagate_down, bottom)
        elif propagate_down[0]:
            grad = top[0].diff.copy()   # dy may be the bottom's diff when run in place
            dx = bottom[0].diff
            dx[...] = 0
            self.cropped(dx)[...] = grad
