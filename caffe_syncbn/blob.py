"""Blob: an N-d array with its gradient, as in Caffe."""
import numpy as np


class Blob:
    """Holds ``data`` and ``diff`` of one shape on one backend (``xp``).

    ``data``/``diff`` are plain arrays; pycaffe code that writes
    ``blob.data[...] = x`` works unchanged. The diff is made (zeros) when first used, so
    nets that never run backward hold none.
    """

    def __init__(self, shape=(), dtype=np.float32, xp=np):
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.data = xp.zeros(tuple(int(s) for s in shape), self.dtype)
        self._diff = None

    @property
    def diff(self):
        if self._diff is None:
            self._diff = self.xp.zeros(self.data.shape, self.dtype)
        return self._diff

    @diff.setter
    def diff(self, value):
        self._diff = value

    @property
    def shape(self):
        return tuple(self.data.shape)

    @property
    def count(self):
        return int(self.data.size)

    @property
    def num_axes(self):
        return self.data.ndim

    def reshape(self, *shape):
        """Give the blob a new shape; keeps the values when the count is unchanged."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError('blob shape %s has a negative axis' % (shape,))
        if shape == self.shape:
            return
        if int(np.prod(shape)) == self.count:
            self.data = self.data.reshape(shape)
            if self._diff is not None:
                self._diff = self._diff.reshape(shape)
        else:
            self.data = self.xp.zeros(shape, self.dtype)
            self._diff = None

    def share_data(self, other):
        """Caffe's ShareData: this blob's data is the same memory as other's."""
        self.data = other.data

    def canonical_axis(self, axis):
        if not -self.num_axes <= axis < max(self.num_axes, 1):
            raise ValueError('axis %d out of range for a %d-axis blob of shape %s'
                             % (axis, self.num_axes, self.shape))
        return axis % max(self.num_axes, 1)

    def count_range(self, start, end=None):
        """Product of the axes [start, end)."""
        return int(np.prod(self.shape[start:end], dtype=np.int64))

    def __repr__(self):
        return 'Blob(shape=%s, dtype=%s)' % (self.shape, self.dtype.name)
