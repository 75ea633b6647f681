"""Blob: an N-d array with its gradient, as in Caffe.

Shapes are checked before anything is allocated: no negative axis, and no blob whose data
would exceed the memory limit (``memory_limit``: the machine's memory, or less where the
process is limited), so that a wrong ``dim`` is an error naming the bytes, not a
MemoryError or a process killed for memory.
"""
import math
import os
import resource

import numpy as np

from .errors import CaffeError

_limit = {'bytes': None}
MAX_AXES, MAX_AXIS = 32, 2 ** 31 - 1          # Caffe's kMaxBlobAxes and INT_MAX


def memory_limit():
    """The most bytes one blob's data, or a net's, may take: ``set_memory_limit``'s value,
    else the machine's physical memory, or the process's RLIMIT_AS or RLIMIT_DATA if lower."""
    if _limit['bytes'] is not None:
        return _limit['bytes']
    limits = [os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')]
    for kind in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
        soft = resource.getrlimit(kind)[0]
        if _is_a_limit(soft):
            limits.append(soft)
    return min(limits)


def _is_a_limit(soft):
    """Whether an rlimit value limits anything. Python reads the kernel's unsigned rlim_t
    as signed: infinity comes as -1 (or 2**64 - 1), and a limit set above 2**63 bytes
    (``ulimit -v`` of 2**53 KiB or more) as a negative number; neither limits memory."""
    return soft != resource.RLIM_INFINITY and 0 <= soft < 2 ** 63


def set_memory_limit(nbytes=None):
    """Set the limit that ``memory_limit`` returns (None: back to the default)."""
    _limit['bytes'] = None if nbytes is None else int(nbytes)


def data_bytes(shape, dtype):
    return math.prod(int(s) for s in shape) * np.dtype(dtype).itemsize


def checked_shape(shape, dtype=np.float32):
    """``shape`` as a tuple of ints, or a CaffeError: a negative axis, or data larger
    than ``memory_limit()``. (The Net adds the layer's name to the message.)"""
    try:
        shape = tuple(int(s) for s in shape)
    except (TypeError, ValueError, OverflowError):
        raise CaffeError('blob shape %s is not a list of integers' % (shape,)) from None
    if any(s < 0 for s in shape):
        raise CaffeError('blob shape %s has a negative axis' % (list(shape),))
    size, limit = data_bytes(shape, dtype), memory_limit()
    if size > limit:
        raise CaffeError('blob shape %s needs %s, more than the memory limit of %s'
                         % (list(shape), format_bytes(size), format_bytes(limit)))
    if len(shape) > MAX_AXES or any(s > MAX_AXIS for s in shape):
        raise CaffeError("blob shape %s is beyond Caffe's limits (%d axes of at most %d)"
                         % (list(shape), MAX_AXES, MAX_AXIS))
    return shape


def storage_of(array):
    """The array that owns ``array``'s memory (``array`` itself, unless it is a view), so
    that views of one buffer count once."""
    while array.base is not None and hasattr(array.base, 'nbytes'):
        array = array.base
    return array


def address_of(array):
    """Where ``array``'s first element lies, in host or device memory (a numpy array's
    ``data``, a buffer, takes no bfloat16: its address comes from ``ctypes``)."""
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr


def format_bytes(count):
    """'2.0 GiB (2147483648 bytes)'."""
    for unit, size in (('TiB', 1 << 40), ('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
        if count >= size:
            return '%.1f %s (%d bytes)' % (count / size, unit, count)
    return '%d bytes' % count


class OutOfMemory(CaffeError, MemoryError):
    """An allocation the process could not make, named with its bytes (``out_of_memory``):
    a CaffeError, one line, and a MemoryError, which the Net turns into one naming the
    layer that asked."""


def out_of_memory(what, nbytes, on_host=True):
    """The OutOfMemory of ``what`` (a blob of shape [..], the arena of a memory plan, ...),
    which asked for ``nbytes``; in host memory, with the process's limit where it has one."""
    return OutOfMemory('out of memory: %s needs %s%s' % (
        what, format_bytes(nbytes), _limit_note() if on_host else ' on the device'))


def out_of_memory_text(exc):
    """What a MemoryError says: ours as it is; numpy's with the shape and bytes it asked
    for; another's (a library that ran out) with its own words."""
    if isinstance(exc, OutOfMemory):
        return str(exc)
    if hasattr(exc, '_total_size'):      # numpy's _ArrayMemoryError
        return str(out_of_memory('an array of shape %s (%s)' % (list(exc.shape), exc.dtype),
                                 exc._total_size))
    return 'out of memory%s' % (' (%s)' % exc if str(exc) else '')


def _limit_note():
    """Where the process has an address-space or data limit, which it is."""
    for kind, name in ((resource.RLIMIT_AS, 'address space (ulimit -v)'),
                       (resource.RLIMIT_DATA, 'data (ulimit -d)')):
        soft = resource.getrlimit(kind)[0]
        if soft != resource.RLIM_INFINITY:
            return '; the process may take %s of %s' % (format_bytes(soft), name)
    return ''


def _zeros(xp, shape, dtype):
    what = 'a blob of shape %s' % list(shape)
    try:
        return xp.zeros(shape, dtype)
    except MemoryError:
        raise out_of_memory(what, data_bytes(shape, dtype), on_host=xp is np) from None
    except ValueError as exc:            # numpy's "array is too big"
        raise CaffeError('cannot allocate %s for %s: %s' % (
            format_bytes(data_bytes(shape, dtype)), what, str(exc).split(';')[0])) from None


class Blob:
    """Holds ``data`` and ``diff`` of one shape on one backend (``xp``).

    ``data``/``diff`` are plain arrays; pycaffe code that writes
    ``blob.data[...] = x`` works unchanged. The diff is made (zeros) when first used, so
    nets that never run backward hold none.
    """

    def __init__(self, shape=(), dtype=np.float32, xp=np):
        self.xp = xp
        self.dtype = np.dtype(dtype)
        shape = checked_shape(shape, self.dtype)
        self.data = _zeros(xp, shape, self.dtype)
        self._diff = None

    @property
    def diff(self):
        """The gradient, allocated on first use: a net that never runs backward holds none."""
        if self._diff is None:
            self._diff = _zeros(self.xp, self.data.shape, self.dtype)
        return self._diff

    @diff.setter
    def diff(self, value):
        self._diff = value

    @property
    def diff_if_made(self):
        """The gradient if it has been used, else None (nothing is allocated)."""
        return self._diff

    @property
    def shape(self):
        return tuple(self.data.shape)

    @property
    def count(self):
        return int(self.data.size)

    @property
    def num_axes(self):
        return self.data.ndim

    # Caffe's legacy 4-D accessors: a missing axis counts as 1.
    @property
    def num(self):
        return self.legacy_shape(0)

    @property
    def channels(self):
        return self.legacy_shape(1)

    @property
    def height(self):
        return self.legacy_shape(2)

    @property
    def width(self):
        return self.legacy_shape(3)

    def legacy_shape(self, index):
        if self.num_axes > 4:
            raise CaffeError('blob of shape %s has %d axes; num/channels/height/width need at '
                             'most 4 (use .shape)' % (self.shape, self.num_axes))
        return self.shape[index] if index < self.num_axes else 1

    def reshape(self, *shape):
        """Give the blob a new shape; keeps the values when the count is unchanged."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        if tuple(shape) == self.shape:
            return
        shape = checked_shape(shape, self.dtype)
        if data_bytes(shape, self.dtype) == self.data.nbytes:
            self.data = self.data.reshape(shape)
            if self._diff is not None:
                self._diff = self._diff.reshape(shape)
        else:
            self.data = _zeros(self.xp, shape, self.dtype)
            self._diff = None

    def retype(self, dtype):
        """Give the blob another dtype: zeros of its shape, and a diff made when first used."""
        self.dtype = np.dtype(dtype)
        self.data = _zeros(self.xp, self.data.shape, self.dtype)
        self._diff = None

    def view(self, array):
        """Make ``data`` the array given (a view of another blob's storage); the diff,
        if the shape changes, is made again when first used."""
        checked_shape(array.shape, self.dtype)
        if array.shape != self.data.shape:
            self._diff = None
        self.data = array

    def reshaped_view(self, shape):
        """A Blob that views this one's data and diff under another shape (a param shared
        by count, PERMISSIVE)."""
        view = Blob.__new__(Blob)
        view.xp, view.dtype = self.xp, self.dtype
        view.data, view.diff = self.data.reshape(shape), self.diff.reshape(shape)
        return view

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
        return int(math.prod(self.shape[start:end]))

    def __repr__(self):
        return 'Blob(shape=%s, dtype=%s)' % (self.shape, self.dtype.name)
