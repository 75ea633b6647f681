"""R-FCN's PSROIPooling (daijifeng001/caffe-rfcn), as the fork's CUDA kernels compute it
(docs/fork-layers.md), in array code that runs on numpy and CuPy alike and reads nothing
back from the device inside a pass.

Every ROI (batch index, x1, y1, x2, y2) is cut into group_size x group_size bins; bin (i, j)
of output channel c is the mean of input channel (c * group_size + i) * group_size + j over
the bin. The bins' edges follow the kernel's arithmetic in the layer's float type: the
corners rounded (halves away from zero) BEFORE they are scaled, the end one past its rounded
corner, an extent of at least 0.1, and the edges floor(k * bin + start) and ceil((k + 1) *
bin + start), each product and sum fused into one rounding as nvcc fuses them, clipped to
the map. An empty bin gives 0 and no gradient; the ROIs get none.

The means come from a summed-area table of the input (float64): four reads per output cell,
whatever the bin's size. The backward spreads each output's gradient over its bin through
the four corners of a table of differences, summed up the same way.
"""
import numpy as np

from ...backend import get_array_module, to_numpy
from ...layer import Layer, register
from .array import scatter_add
from .roi_pooling import caffe_round

#: the least ROI extent (in map cells) the kernel allows, a double in its source
MIN_EXTENT = 0.1


def summed_area(a):
    """(..., H + 1, W + 1) float64 whose [h, w] is the sum of a[..., :h, :w]."""
    xp = get_array_module(a)
    table = xp.zeros(a.shape[:-2] + (a.shape[-2] + 1, a.shape[-1] + 1), np.float64)
    table[..., 1:, 1:] = a.astype(np.float64).cumsum(-2).cumsum(-1)
    return table


def bin_edges(rois, spatial_scale, group, height, width, dtype):
    """Per ROI (R rows of 5 values, any array module): its batch index as the kernel reads
    it (truncated), and the [start, end) rows (R, group) and columns (R, group) of its bins,
    clipped to the map, in the arithmetic of the fork's kernel in ``dtype``."""
    xp = get_array_module(rois)
    dtype = np.dtype(dtype)
    rois = rois.reshape(-1, 5).astype(dtype)
    scale = dtype.type(spatial_scale)
    # x then y: columns 1 and 2 are the start corner, 3 and 4 the end
    start = caffe_round(rois[:, 1:3]).astype(dtype) * scale
    end = (caffe_round(rois[:, 3:5]) + 1).astype(dtype) * scale
    extent = xp.maximum((end - start).astype(np.float64), MIN_EXTENT).astype(dtype)
    bin_size = extent / dtype.type(group)
    steps = xp.arange(group + 1, dtype=np.float64)[None, :, None]
    # k * bin + start with one rounding into the float type (a fused multiply-add); the
    # product of the small integer k and the bin is exact in float64, and so is the sum
    fused = (steps * bin_size[:, None, :].astype(np.float64) +
             start[:, None, :].astype(np.float64)).astype(dtype)
    fused = xp.where(xp.isfinite(fused), fused, 0)      # a bad ROI: the layer's check
    low, high = xp.floor(fused[:, :-1]), xp.ceil(fused[:, 1:])
    edges = []
    for axis, size in ((1, height), (0, width)):
        edges.append((xp.clip(low[:, :, axis], 0, size).astype(np.int64),
                      xp.clip(high[:, :, axis], 0, size).astype(np.int64)))
    image = xp.trunc(xp.where(xp.isfinite(rois[:, 0]), rois[:, 0], -1)).astype(np.int64)
    return image, edges[0], edges[1]


def bad_roi(rois, batch):
    """What is wrong with the first bad ROI of host ``rois`` (R, 5), for a map of ``batch``
    images: a value that is not finite, or a batch index out of range."""
    finite = np.isfinite(rois).all(axis=1)
    image = np.where(finite, np.trunc(np.where(finite, rois[:, 0], 0)), -1)
    index = int(np.flatnonzero(~finite | (image < 0) | (image >= batch))[0])
    if not finite[index]:
        return 'ROI %d is not finite: %s' % (index, rois[index].tolist())
    return 'ROI %d has batch index %d; bottom 0 holds %d image(s)' % (index, image[index], batch)


@register('PSROIPooling')
class PSROIPoolingLayer(Layer):
    """R-FCN's position-sensitive ROI average pooling (module docstring). Bottom 0 is the
    (N, output_dim * group_size^2, H, W) score map, bottom 1 the ROIs, 5 values each; the
    top is (R, output_dim, group_size, group_size)."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, exact=1)
        p = self.param.psroi_pooling_param
        missing = [name for name in ('spatial_scale', 'output_dim', 'group_size')
                   if not p.HasField(name)]
        if missing:
            raise self.error('psroi_pooling_param needs %s (R-FCN requires all three)'
                             % ', '.join(missing))
        if p.output_dim < 1 or p.group_size < 1:
            raise self.error('output_dim and group_size must be positive, got %d and %d'
                             % (p.output_dim, p.group_size))
        if not np.isfinite(p.spatial_scale):
            raise self.error('spatial_scale must be finite, got %g' % p.spatial_scale)
        self.output_dim, self.group = p.output_dim, p.group_size
        self.spatial_scale = p.spatial_scale

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error('bottom 0 must be (N, C, H, W), got shape %s' % (bottom[0].shape,))
        channels = self.output_dim * self.group ** 2
        if bottom[0].shape[1] != channels:
            raise self.error('bottom 0 has %d channels; output_dim %d x group_size %d^2 needs %d'
                             % (bottom[0].shape[1], self.output_dim, self.group, channels))
        rois = bottom[1]
        if rois.num_axes < 1 or rois.count != 5 * rois.shape[0]:
            raise self.error('bottom 1 must hold 5 values per ROI (batch index, x1, y1, x2, y2), '
                             'got shape %s' % (rois.shape,))
        top[0].reshape((rois.shape[0], self.output_dim, self.group, self.group))

    def _cells(self, rois, shape):
        """Per output cell (R, output_dim, G, G): the flat index into a (N, C, H + 1, W + 1)
        table of each corner of its bin (+ +, + -, - +, - -: the signs of the summed-area
        read), and the bin's area (0 for an empty bin). Bad ROIs are the pass's check."""
        xp, group = self.xp, self.group
        n, c, h, w = shape
        image, (top_row, bottom_row), (left, right) = bin_edges(
            rois, self.spatial_scale, group, h, w, self.dtype)
        values = rois.reshape(-1, 5)
        valid = xp.isfinite(values).all(axis=1) & (image >= 0) & (image < n)
        self.ctx.check_later(self, ~valid.all(), lambda: bad_roi(to_numpy(values), n))
        # a bad ROI reads bin 0 of image 0, empty, until the Net reads the check
        image, top_row, bottom_row, left, right = (
            xp.where(valid if e.ndim == 1 else valid[:, None], e, 0)
            for e in (image, top_row, bottom_row, left, right))
        channel = (xp.arange(self.output_dim)[:, None, None] * group +
                   xp.arange(group)[None, :, None]) * group + xp.arange(group)[None, None, :]
        plane = (image[:, None, None, None] * c + channel[None]) * (h + 1)
        rows = [r[:, None, :, None] for r in (bottom_row, top_row)]
        cols = [col[:, None, None, :] for col in (right, left)]
        corners = [(plane + row) * (w + 1) + col for row in rows for col in cols]
        area = xp.broadcast_to((rows[0] - rows[1]) * (cols[0] - cols[1]), corners[0].shape)
        return corners, area

    def forward(self, bottom, top):
        xp = self.xp
        x = bottom[0].data
        self._corners, self._area = self._cells(bottom[1].data, x.shape)
        table = summed_area(x).reshape(-1)
        plus_plus, plus_minus, minus_plus, minus_minus = (table[i] for i in self._corners)
        total = plus_plus - plus_minus - minus_plus + minus_minus
        area = self._area
        top[0].data[...] = xp.where(area > 0, total / xp.maximum(area, 1), 0)

    def backward_reads(self, bottom, top):
        return []                           # the bins of the forward are kept

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        xp = self.xp
        n, c, h, w = bottom[0].shape
        area = self._area
        share = xp.where(area > 0, top[0].diff.astype(np.float64) / xp.maximum(area, 1), 0)
        # a bin's rectangle [top, bottom) x [left, right) gets its share: + at (top, left)
        # and (bottom, right), - at the other two corners, summed over rows and columns
        differences = xp.zeros(n * c * (h + 1) * (w + 1), np.float64)
        for corner, sign in zip(self._corners, (1, -1, -1, 1)):
            scatter_add(differences, corner.reshape(-1), (sign * share).reshape(-1))
        differences = differences.reshape(n, c, h + 1, w + 1)
        bottom[0].diff[...] = differences.cumsum(-2).cumsum(-1)[..., :h, :w]

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0          # the ROIs get no gradient, as in the fork
