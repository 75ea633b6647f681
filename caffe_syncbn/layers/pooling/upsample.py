"""Vision layers of other Caffe forks that popular models need: SegNet's Upsample (with the
YOLO ports' nearest-neighbour form), ShuffleNet's ShuffleChannel, SENet's Axpy and
py-faster-rcnn's ROIPooling. Each follows its fork's arithmetic (docs/fork-layers.md) as
array code that runs on numpy and CuPy alike.
"""
import math
import numpy as np

from ...backend import to_numpy
from ...layer import Layer, register
from .layers import scatter_add


@register('Upsample')
class UpsampleLayer(Layer):
    """With a second bottom (a MAX Pooling layer's mask top), SegNet's unpooling: each value
    goes to the position ``h * W + w`` its mask names in a zero plane of upsample_h x
    upsample_w (or H * scale_h - pad_out_h by W * scale_w - pad_out_w). With one bottom, the
    YOLO ports' (darknet2caffe's) nearest-neighbour upsampling by ``scale``."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=1, maximum=2)
        self.check_tops(top, exact=1)
        up = self.param.upsample_param
        self.unpooling = len(bottom) == 2
        self.fixed_hw = None
        if up.HasField('upsample_h') != up.HasField('upsample_w'):
            raise self.error('upsample_h and upsample_w go together; got only %s'
                             % ('upsample_h' if up.HasField('upsample_h') else 'upsample_w'))
        if up.HasField('scale_h') != up.HasField('scale_w'):
            raise self.error('scale_h and scale_w go together; got only %s'
                             % ('scale_h' if up.HasField('scale_h') else 'scale_w'))
        if up.HasField('upsample_h'):
            if not self.unpooling:
                raise self.error('upsample_h/upsample_w need the pooling mask as bottom 1; '
                                 'with one bottom give scale')
            self.fixed_hw = (up.upsample_h, up.upsample_w)
            if min(self.fixed_hw) < 2:
                raise self.error('upsample_h and upsample_w must be at least 2, got %d x %d'
                                 % self.fixed_hw)
            return
        if up.HasField('scale_h') and up.HasField('scale'):
            raise self.error('give scale or scale_h/scale_w, not both')
        self.scale = (up.scale_h, up.scale_w) if up.HasField('scale_h') else (up.scale,) * 2
        self.pad_out = (int(up.pad_out_h), int(up.pad_out_w))
        if min(self.scale) < 1 or (self.unpooling and min(self.scale) < 2):
            raise self.error('scale must be at least %d, got %s'
                             % (2 if self.unpooling else 1, self.scale))
        for axis, scale, pad in zip('hw', self.scale, self.pad_out):
            if pad and (scale != 2 or not self.unpooling):
                raise self.error('pad_out_%s needs the mask bottom and scale_%s 2, got scale %d '
                                 'and %d bottom(s)' % (axis, axis, scale, len(bottom)))

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.error('bottom 0 must be (N, C, H, W), got shape %s' % (shape,))
        if self.unpooling and bottom[1].shape != shape:
            raise self.error('the mask (bottom 1) must have the shape of bottom 0 %s, got %s'
                             % (shape, bottom[1].shape))
        if self.fixed_hw is not None:
            self.out_hw = self.fixed_hw
        else:
            self.out_hw = tuple(size * scale - pad for size, scale, pad in
                                zip(shape[2:], self.scale, self.pad_out))
        top[0].reshape(shape[:2] + self.out_hw)

    def _flat_targets(self, bottom):
        """Each input value's index in the flattened top: its plane's start + its mask."""
        xp = self.xp
        planes, plane = bottom[0].shape[0] * bottom[0].shape[1], self.out_hw[0] * self.out_hw[1]
        index = bottom[1].data.reshape(planes, bottom[1].count // max(planes, 1)).astype(np.int64)
        if index.size == 0:
            return index.reshape(-1)
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= plane:
            raise self.error('mask index %d is outside the %d x %d top plane: the Pooling layer '
                             "that made the mask must have had this layer's top size as input"
                             % (high if high >= plane else low, *self.out_hw))
        return (index + xp.arange(planes, dtype=np.int64)[:, None] * plane).reshape(-1)

    def forward(self, bottom, top):
        x = bottom[0].data
        if not self.unpooling:
            sh, sw = self.scale
            top[0].data[...] = x.repeat(sh, axis=2).repeat(sw, axis=3)
            return
        out = top[0].data.reshape(-1)
        out[...] = 0
        # where a mask repeats an index (overlapping pooling windows) the last value in
        # row-major order stays, as in the fork's loop
        out[self._flat_targets(bottom)] = x.reshape(-1)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dy = top[0].diff
        if not self.unpooling:
            (sh, sw), (n, c, h, w) = self.scale, bottom[0].shape
            bottom[0].diff[...] = dy.reshape(n, c, h, sh, w, sw).sum(axis=(3, 5))
            return
        # the fork hands every input the diff at its mask position, repeated or not
        bottom[0].diff[...] = dy.reshape(-1)[self._flat_targets(bottom)].reshape(
            bottom[0].shape)

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0          # bottom 1 holds indices


@register('ShuffleChannel')
class ShuffleChannelLayer(Layer):
    """ShuffleNet's channel shuffle: channels as (group, C / group), transposed."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        self.group = self.param.shuffle_channel_param.group
        if self.group < 1:
            raise self.error('group must be positive, got %d' % self.group)

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        if len(shape) < 2 or shape[1] % self.group:
            raise self.error('group %d must divide the channels (axis 1) of the bottom, shape %s'
                             % (self.group, shape))
        top[0].reshape(shape)

    @staticmethod
    def _shuffle(array, rows):
        """``array``'s channels read as a (rows, C / rows) matrix, transposed."""
        n, c = array.shape[:2]
        positions = int(math.prod(array.shape[2:]))          # an empty axis makes 0, not -1's guess
        return array.reshape(n, rows, c // rows, positions).swapaxes(1, 2).reshape(array.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self._shuffle(bottom[0].data, self.group)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:      # the inverse permutation: the transpose the other way
            c = bottom[0].shape[1]
            bottom[0].diff[...] = self._shuffle(top[0].diff, c // self.group)


@register('Axpy')
class AxpyLayer(Layer):
    """SENet's Axpy: ``top = a * x + y`` for bottoms (a, x, y); a holds one scale per image
    and channel, (N, C) or (N, C, 1, 1)."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=3)
        self.check_tops(top, exact=1)

    def reshape(self, bottom, top):
        a, x, y = (b.shape for b in bottom)
        if len(x) < 2 or a[:2] != x[:2] or any(d != 1 for d in a[2:]):
            raise self.error('bottom 0 (the scale) must be (N, C) or (N, C, 1, 1) of bottom 1 '
                             'shape %s, got %s' % (x, a))
        if y != x:
            raise self.error('bottoms 1 and 2 must have one shape, got %s and %s' % (x, y))
        top[0].reshape(x)

    def _scale(self, bottom):
        x = bottom[1]
        return bottom[0].data.reshape(x.shape[:2] + (1,) * (x.num_axes - 2))

    def forward(self, bottom, top):
        top[0].data[...] = self._scale(bottom) * bottom[1].data + bottom[2].data

    def backward(self, top, propagate_down, bottom):
        dy = top[0].diff.copy() if any(top[0] is b for b in bottom) else top[0].diff
        if propagate_down[0]:
            spatial = tuple(range(2, bottom[1].num_axes))
            bottom[0].diff[...] = (dy * bottom[1].data).sum(axis=spatial).reshape(
                bottom[0].shape)
        if propagate_down[1]:
            bottom[1].diff[...] = self._scale(bottom) * dy
        if propagate_down[2]:
            bottom[2].diff[...] = dy


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
