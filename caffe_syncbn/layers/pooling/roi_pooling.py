"""py-faster-rcnn's ROIPooling, as the fork computes it (docs/fork-layers.md), in array code
that runs on numpy and CuPy alike."""
import numpy as np

from ...backend import to_numpy
from ...layer import Layer, register
from .array import scatter_add


def caffe_round(values):
    """C's round(): halves away from zero (numpy's round takes them to even)."""
    whole = np.trunc(values)
    return whole + np.sign(values) * (np.abs(values - whole) >= 0.5)


@register('ROIPooling')
class ROIPoolingLayer(Layer):
    """py-faster-rcnn's ROI max pooling. Bottom 1 holds R rows (batch index, x1, y1, x2, y2)
    in image coordinates; each is scaled by spatial_scale and rounded, and its (inclusive)
    extent cut into pooled_h x pooled_w bins of floor/ceil edges. An empty bin gives 0."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, exact=1)
        rp = self.param.roi_pooling_param
        self.pooled = (rp.pooled_h, rp.pooled_w)
        if min(self.pooled) < 1:
            raise self.error('pooled_h and pooled_w must be positive, got %d x %d' % self.pooled)
        self.spatial_scale = rp.spatial_scale
        if not np.isfinite(self.spatial_scale):
            raise self.error('spatial_scale must be finite, got %g' % self.spatial_scale)

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error('bottom 0 must be (N, C, H, W), got shape %s' % (bottom[0].shape,))
        rois = bottom[1]
        if rois.num_axes < 1 or rois.count != 5 * rois.shape[0]:
            raise self.error('bottom 1 must hold 5 values per ROI (batch index, x1, y1, x2, y2), '
                             'got shape %s' % (rois.shape,))
        top[0].reshape((rois.shape[0], bottom[0].shape[1]) + self.pooled)

    def _bins(self, rois, shape):
        """Per ROI: its image, and the [start, end) rows (R, pooled_h) and columns
        (R, pooled_w) of its bins, clipped to the image, in the fork's float arithmetic."""
        dtype = self.dtype
        rois = to_numpy(rois).reshape(-1, 5).astype(dtype)
        bad = np.flatnonzero(~np.isfinite(rois).all(axis=1))
        if bad.size:
            raise self.error('ROI %d is not finite: %s' % (bad[0], rois[bad[0]].tolist()))
        batch, height, width = shape[0], shape[2], shape[3]
        image = rois[:, 0].astype(np.int64)            # C++ int conversion: truncation
        bad = np.flatnonzero((image < 0) | (image >= batch))
        if bad.size:
            raise self.error('ROI %d has batch index %d; bottom 0 holds %d image(s)'
                             % (bad[0], image[bad[0]], batch))
        corners = caffe_round(rois[:, 1:] * dtype.type(self.spatial_scale)).astype(np.int64)
        edges = []
        for start, end, pooled, size in ((corners[:, 1], corners[:, 3], self.pooled[0], height),
                                         (corners[:, 0], corners[:, 2], self.pooled[1], width)):
            extent = np.maximum(end - start + 1, 1).astype(dtype)
            bin_size = (extent / dtype.type(pooled))[:, None]
            steps = np.arange(pooled + 1, dtype=dtype)[None, :]
            low = np.floor(steps[:, :-1] * bin_size).astype(np.int64) + start[:, None]
            high = np.ceil(steps[:, 1:] * bin_size).astype(np.int64) + start[:, None]
            edges.append((np.clip(low, 0, size), np.clip(high, 0, size)))
        return image, edges[0], edges[1]

    def forward(self, bottom, top):
        xp = self.xp
        x = bottom[0].data
        image, rows, cols = self._bins(bottom[1].data, x.shape)
        out, self.argmax = top[0].data, xp.empty(top[0].shape, np.int64)
        for r in range(len(image)):
            out[r], self.argmax[r] = self._pool_roi(x[image[r]], (rows[0][r], rows[1][r]),
                                                    (cols[0][r], cols[1][r]))
        self.image = xp.asarray(image)

    def _pool_roi(self, x, rows, cols):
        """One ROI's (C, pooled_h, pooled_w) maxima of image ``x`` (C, H, W), and the index
        h * W + w of each (-1 for an empty bin, whose maximum is 0). ``rows`` and ``cols``
        are its bins' [start, end) edges: first the maximum over each column bin, row by row,
        then over each row bin of those; the first maximum in row-major order wins, as in
        the fork's scan."""
        xp = self.xp
        first, last = int(rows[0].min()), int(rows[1].max())
        if last <= first or cols[1].max() <= cols[0].min():
            return 0, -1                                        # every bin is empty
        band = x[:, first:last]                                 # the rows the ROI covers
        column_max, column_at = self._bin_max(band, cols, axis=2)
        value, row_at = self._bin_max(column_max, (rows[0] - first, rows[1] - first), axis=1)
        column = xp.take_along_axis(column_at, row_at, axis=1)
        index = (row_at + first) * x.shape[2] + column
        empty = xp.asarray((rows[1] <= rows[0])[:, None] | (cols[1] <= cols[0])[None, :])
        return xp.where(empty, 0, value), xp.where(empty, -1, index)

    def _bin_max(self, a, edges, axis):
        """The maximum of ``a`` over each bin [start, end) of ``edges`` along ``axis``, which
        becomes the bin axis, and the position along ``axis`` of its first maximum. Each bin
        is gathered as a window of the widest bin's size; a narrower one reads -inf past its
        end (a cell appended to ``a``)."""
        xp = self.xp
        starts, ends = edges
        size = a.shape[axis]
        width = max(int((ends - starts).max()), 1)
        index = starts[:, None] + np.arange(width)[None, :]        # (bins, width)
        index[index >= ends[:, None]] = size
        stop_shape = a.shape[:axis] + (1,) + a.shape[axis + 1:]
        padded = xp.concatenate([a, xp.full(stop_shape, -np.inf, a.dtype)], axis=axis)
        windows = xp.take(padded, xp.asarray(index.reshape(-1)), axis=axis)
        windows = windows.reshape(a.shape[:axis] + index.shape + a.shape[axis + 1:])
        offset = windows.argmax(axis=axis + 1)                 # numpy and CuPy: the first
        best = xp.take_along_axis(windows, xp.expand_dims(offset, axis + 1), axis + 1)
        position = xp.asarray(starts.reshape((-1,) + (1,) * (a.ndim - axis - 1))) + offset
        return best.squeeze(axis + 1), xp.minimum(position, size - 1)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        xp = self.xp
        n, c, h, w = bottom[0].shape
        dx = bottom[0].diff
        dx[...] = 0
        # each top cell's diff goes to its maximum in its ROI's image; empty bins give none
        plane = (self.image[:, None] * c + xp.arange(c)[None, :]) * (h * w)
        flat = self.argmax + plane[:, :, None, None]
        found = self.argmax >= 0
        scatter_add(dx.reshape(-1), flat[found], top[0].diff[found])

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0          # the ROIs get no gradient, as in the fork
