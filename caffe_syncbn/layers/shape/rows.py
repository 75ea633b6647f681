"""BatchReindex and Filter: layers that pick items of the batch (axis 0), whose gradient adds
each picked item's diff back to its source item."""
import numpy as np

from ...backend import to_numpy
from ...layer import Layer, register


def _gather_rows_gradient(xp, dy, rows, num_rows, dtype):
    """d(bottom) of top = bottom[rows]: each top row's diff added to its source row.

    A one-hot matrix product sums repeated rows without a scatter-add."""
    one_hot = (xp.arange(num_rows)[:, None] == rows[None, :]).astype(dtype)
    return (one_hot @ dy.reshape(len(rows), -1)).reshape((num_rows,) + dy.shape[1:])


@register('BatchReindex')
class BatchReindexLayer(Layer):
    """top[i] = bottom0[int(bottom1[i])]: items picked (and repeated) along axis 0."""

    def reshape(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, exact=1)
        if bottom[1].num_axes != 1:
            raise self.error('the index bottom must be 1-D, got shape %s' % (bottom[1].shape,))
        top[0].reshape((bottom[1].count,) + bottom[0].shape[1:])

    def allow_force_backward(self, bottom_index):
        return bottom_index == 0

    def forward(self, bottom, top):
        xp = self.xp
        self.rows = bottom[1].data.astype(np.int64)
        n = bottom[0].shape[0]
        if self.rows.size and (int(self.rows.min()) < 0 or int(self.rows.max()) >= n):
            raise self.error('indices must be in [0, %d), got %s'
                             % (n, to_numpy(self.rows).tolist()))
        top[0].data[...] = xp.take(bottom[0].data, self.rows, axis=0)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = _gather_rows_gradient(
                self.xp, top[0].diff, self.rows, bottom[0].shape[0], self.dtype)
        if propagate_down[1]:
            bottom[1].diff[...] = 0


@register('Filter')
class FilterLayer(Layer):
    """Keeps the items (axis 0) whose selector (the last bottom) is non-zero."""

    def setup(self, bottom, top):
        self.first_reshape = True

    def reshape(self, bottom, top):
        self.check_bottoms(bottom, minimum=2)
        self.check_tops(top, exact=len(bottom) - 1)
        selector = bottom[-1]
        if any(d != 1 for d in selector.shape[1:]):
            raise self.error('selector axes after the first must be 1, got shape %s'
                             % (selector.shape,))
        for b in bottom[:-1]:
            if b.shape[:1] != selector.shape[:1]:
                raise self.error('bottom shape %s and selector shape %s differ on axis 0'
                                 % (b.shape, selector.shape))
        chosen = np.flatnonzero(to_numpy(selector.data).reshape(-1))
        self.rows = self.xp.asarray(chosen)
        # as in Caffe, tops keep the full batch size until the first forward
        num = selector.shape[0] if self.first_reshape else len(chosen)
        self.first_reshape = False
        for t, b in zip(top, bottom):
            t.reshape((num,) + b.shape[1:])

    def allow_force_backward(self, bottom_index):
        return bottom_index != len(self.param.bottom) - 1

    def forward(self, bottom, top):
        for t, b in zip(top, bottom):
            t.data[...] = self.xp.take(b.data, self.rows, axis=0)

    def backward(self, top, propagate_down, bottom):
        for t, b, down in zip(top, bottom, propagate_down):
            if down:
                b.diff[...] = _gather_rows_gradient(self.xp, t.diff, self.rows,
                                                    b.shape[0], self.dtype)
        if propagate_down[-1]:
            bottom[-1].diff[...] = 0
