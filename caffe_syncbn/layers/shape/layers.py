"""Layers that move, copy or combine values without learned weights (plus Parameter, whose
top is its learned blob), and canonical_axis, which every layer with an axis reads."""
import numpy as np

from ...backend.cpu_threads import blocks
from ...layer import Layer, register


def canonical_axis(layer, blob, axis):
    """``axis`` of ``blob`` made non-negative, with a layer-named error when out of range."""
    n = blob.num_axes
    if not -n <= axis < max(n, 1):
        raise layer.error('axis %d is out of range for a bottom of shape %s' % (axis, blob.shape))
    return axis % max(n, 1)


def share_view(top, source, shape):
    """Make ``top.data`` a view of ``source`` with ``shape`` (Caffe's ShareData);
    ``top.diff`` stays the top's own array. Nothing of the top's size is allocated.
    A view of the shape the top has already passed Blob.view's checks: the net reshapes
    every layer before every forward, and those checks cost more than a small layer."""
    view = source.reshape(shape)
    if view.shape == top.data.shape:
        top.data = view
    else:
        top.view(view)


@register('Split')
class SplitLayer(Layer):
    """Every top shares the bottom's data; backward sums the tops' diffs."""

    def reshape(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, minimum=1)
        if any(t is bottom[0] for t in top):
            raise self.error('cannot run in place (a top is its bottom)')
        for t in top:
            share_view(t, bottom[0].data, bottom[0].shape)

    def forward(self, bottom, top):
        for t in top:
            t.data = bottom[0].data

    def backward_reads(self, bottom, top):
        return []

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        out = bottom[0].diff.reshape(-1)
        diffs = [t.diff.reshape(-1) for t in top]

        def work(a, b):
            if len(diffs) == 1:
                out[a:b] = diffs[0][a:b]
                return
            self.xp.add(diffs[0][a:b], diffs[1][a:b], out=out[a:b])
            for d in diffs[2:]:
                out[a:b] += d[a:b]
        blocks(self.xp, out.size, 1, work)


@register('Concat')
class ConcatLayer(Layer):
    def setup(self, bottom, top):
        p = self.param.concat_param
        if p.HasField('axis') and p.HasField('concat_dim'):
            raise self.error('set either axis or the legacy concat_dim, not both')
        self.use_concat_dim = p.HasField('concat_dim')

    def reshape(self, bottom, top):
        self.check_bottoms(bottom, minimum=1)
        self.check_tops(top, exact=1)
        p = self.param.concat_param
        first = bottom[0]
        self.axis = p.concat_dim if self.use_concat_dim else p.axis
        self.axis = canonical_axis(self, first, self.axis)
        for b in bottom[1:]:
            same = b.num_axes == first.num_axes and all(
                b.shape[i] == first.shape[i] for i in range(first.num_axes) if i != self.axis)
            if not same:
                raise self.error('bottoms must match except on axis %d: %s vs %s'
                                 % (self.axis, first.shape, b.shape))
        shape = list(first.shape)
        shape[self.axis] = sum(b.shape[self.axis] for b in bottom)
        top[0].reshape(shape)

    def forward(self, bottom, top):
        start = 0
        for b in bottom:           # straight into the top: no concatenated temporary
            size = b.shape[self.axis]
            top[0].data[(slice(None),) * self.axis + (slice(start, start + size),)] = b.data
            start += size

    def backward_reads(self, bottom, top):
        return []

    def rerunnable(self):
        return True

    def backward(self, top, propagate_down, bottom):
        start = 0
        for b, down in zip(bottom, propagate_down):
            size = b.shape[self.axis]
            if down:
                window = (slice(None),) * self.axis + (slice(start, start + size),)
                b.diff[...] = top[0].diff[window]
            start += size


@register('Slice')
class SliceLayer(Layer):
    def setup(self, bottom, top):
        p = self.param.slice_param
        if p.HasField('axis') and p.HasField('slice_dim'):
            raise self.error('set either axis or the legacy slice_dim, not both')

    def reshape(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, minimum=1)
        p = self.param.slice_param
        x = bottom[0]
        self.axis = canonical_axis(self, x, p.slice_dim if p.HasField('slice_dim') else p.axis)
        length = x.shape[self.axis]
        if p.slice_point:
            if len(p.slice_point) != len(top) - 1:
                raise self.error('%d slice_point values for %d tops (expected %d)'
                                 % (len(p.slice_point), len(top), len(top) - 1))
            bounds = [0] + list(p.slice_point) + [length]
            if any(a >= b for a, b in zip(bounds, bounds[1:])):
                raise self.error('slice_point %s must increase strictly inside (0, %d)'
                                 % (list(p.slice_point), length))
        else:
            if length % len(top):
                raise self.error('axis %d of size %d does not split equally into %d tops'
                                 % (self.axis, length, len(top)))
            step = length // len(top)
            bounds = [k * step for k in range(len(top) + 1)]
        self.windows = [(slice(None),) * self.axis + (slice(a, b),)
                        for a, b in zip(bounds, bounds[1:])]
        for t, (a, b) in zip(top, zip(bounds, bounds[1:])):
            shape = list(x.shape)
            shape[self.axis] = b - a
            t.reshape(shape)

    def forward(self, bottom, top):
        for t, window in zip(top, self.windows):
            t.data[...] = bottom[0].data[window]

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = self.xp.concatenate([t.diff for t in top], axis=self.axis)


class _ViewLayer(Layer):
    """A top that is the bottom with another shape (data shared, as in Caffe)."""

    def top_shape(self, x):
        raise NotImplementedError

    def reshape(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        if top[0] is bottom[0]:
            raise self.error('cannot run in place (the top is its bottom)')
        if bottom[0].shape != getattr(self, '_shape_of_bottom', None):    # checked once a shape
            self.shape = tuple(self.top_shape(bottom[0]))
            self._shape_of_bottom = bottom[0].shape
        share_view(top[0], bottom[0].data, self.shape)

    def forward(self, bottom, top):
        top[0].data = bottom[0].data.reshape(self.shape)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff.reshape(bottom[0].shape)


@register('Flatten')
class FlattenLayer(_ViewLayer):
    def top_shape(self, x):
        p = self.param.flatten_param
        start = canonical_axis(self, x, p.axis)
        end = canonical_axis(self, x, p.end_axis)
        if end < start:
            raise self.error('end_axis %d comes before axis %d' % (p.end_axis, p.axis))
        return x.shape[:start] + (x.count_range(start, end + 1),) + x.shape[end + 1:]


@register('Reshape')
class ReshapeLayer(_ViewLayer):
    """Replaces axes [axis, axis + num_axes) by ``shape``: 0 copies the bottom's
    size at that position, one -1 is inferred from the count."""

    def top_shape(self, x):
        p = self.param.reshape_param
        dims = list(p.shape.dim)
        start = p.axis if p.axis >= 0 else x.num_axes + p.axis + 1
        if not 0 <= start <= x.num_axes:
            raise self.error('axis %d is out of range for a bottom of shape %s'
                             % (p.axis, x.shape))
        if p.num_axes < -1:
            raise self.error('num_axes must be >= -1, got %d' % p.num_axes)
        end = x.num_axes if p.num_axes == -1 else start + p.num_axes
        if end > x.num_axes:
            raise self.error('axis %d + num_axes %d exceed the %d axes of bottom shape %s'
                             % (start, p.num_axes, x.num_axes, x.shape))
        if dims.count(-1) > 1:
            raise self.error('shape %s has more than one -1' % dims)
        for i, d in enumerate(dims):
            if d == 0:
                if start + i >= x.num_axes:
                    raise self.error('shape dim %d is 0 but the bottom has no axis %d'
                                     % (i, start + i))
                dims[i] = x.shape[start + i]
            elif d < -1:
                raise self.error('shape dims must be >= -1, got %s' % list(p.shape.dim))
        shape = list(x.shape[:start]) + dims + list(x.shape[end:])
        known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
        if -1 in shape:
            if known == 0 or x.count % known:
                raise self.error('cannot infer the -1 in %s from bottom shape %s'
                                 % (list(p.shape.dim), x.shape))
            shape[shape.index(-1)] = x.count // known
        if int(np.prod(shape, dtype=np.int64)) != x.count:
            raise self.error('top shape %s has a different count than bottom shape %s'
                             % (shape, x.shape))
        return shape


@register('Tile')
class TileLayer(Layer):
    def reshape(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        p = self.param.tile_param
        x = bottom[0]
        if p.tiles < 1:
            raise self.error('tiles must be >= 1, got %d' % p.tiles)
        self.axis = canonical_axis(self, x, p.axis)
        self.tiles = p.tiles
        self.outer = x.count_range(0, self.axis)
        self.inner = x.count_range(self.axis)
        shape = list(x.shape)
        shape[self.axis] *= self.tiles
        top[0].reshape(shape)

    def forward(self, bottom, top):
        x = bottom[0].data.reshape(self.outer, 1, self.inner)
        tiled = self.xp.broadcast_to(x, (self.outer, self.tiles, self.inner))
        top[0].data[...] = tiled.reshape(top[0].shape)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            dy = top[0].diff.reshape(self.outer, self.tiles, self.inner)
            bottom[0].diff[...] = dy.sum(axis=1).reshape(bottom[0].shape)


@register('Crop')
class CropLayer(Layer):
    """Crops bottom 0 to the shape of bottom 1 on the axes from ``axis`` on."""

    def reshape(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, exact=1)
        p = self.param.crop_param
        x, ref = bottom
        if x.num_axes != ref.num_axes:
            raise self.error('bottoms must have as many axes: %s vs %s' % (x.shape, ref.shape))
        start = canonical_axis(self, x, p.axis)
        cropped = x.num_axes - start
        offsets = list(p.offset)
        if len(offsets) not in (0, 1, cropped):
            raise self.error('%d offsets given; expected 0, 1 or %d (one per axis from %d on)'
                             % (len(offsets), cropped, start))
        shape, window = list(x.shape), []
        for i in range(x.num_axes):
            if i < start:
                window.append(slice(None))
                continue
            offset = offsets[0] if len(offsets) == 1 else (offsets[i - start] if offsets else 0)
            if x.shape[i] < ref.shape[i] + offset:
                raise self.error('axis %d: size %d is too small to crop %d at offset %d'
                                 % (i, x.shape[i], ref.shape[i], offset))
            shape[i] = ref.shape[i]
            window.append(slice(offset, offset + ref.shape[i]))
        self.window = tuple(window)
        top[0].reshape(shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data[self.window]

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            if top[0].shape != bottom[0].shape:      # the FPNs' crops often take it all
                bottom[0].diff[...] = 0
            bottom[0].diff[self.window] = top[0].diff
        if propagate_down[1]:
            bottom[1].diff[...] = 0   # only a shape reference


@register('Silence')
class SilenceLayer(Layer):
    """Consumes blobs so they count as used; their gradient is zero."""

    def reshape(self, bottom, top):
        self.check_tops(top, exact=0)

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        for b, down in zip(bottom, propagate_down):
            if down:
                b.diff[...] = 0


@register('Parameter')
class ParameterLayer(Layer):
    """Its top is its learned blob (shared data)."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=0)
        self.check_tops(top, exact=1)
        self.blobs = [self.make_blob(tuple(self.param.parameter_param.shape.dim))]

    def reshape(self, bottom, top):
        share_view(top[0], self.blobs[0].data, self.blobs[0].shape)

    def forward(self, bottom, top):
        top[0].data = self.blobs[0].data

    def backward(self, top, propagate_down, bottom):
        if self.wants_param_gradient(0):
            self.blobs[0].diff += top[0].diff
