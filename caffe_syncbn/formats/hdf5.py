"""HDF5 files that may be damaged, or may not fit on the disk.

libhdf5's failures on a damaged file reach Python as any of several exception types,
depending on the structure the damage hit, with messages that run over several lines.
``reading(path, what)`` turns them into one CaffeError line naming the file, and
``read_dataset`` checks a dataset's type and declared size before reading it, so a
damaged header cannot ask for terabytes. ``writing(path)`` writes atomically, and cleanly
when the disk is full.
"""
import contextlib
import io
import os
import re

from ..blob import data_bytes, format_bytes, memory_limit
from ..errors import CaffeError
from .atomic import atomic_write

#: what h5py raises on a damaged file
FAILURES = (OSError, RuntimeError, KeyError, ValueError, TypeError, AttributeError)


def reason(exc):
    """One line saying why h5py could not read a file: the system's text for its errno,
    or the one libhdf5 quotes in its report ("error message = '...'"), or the start of
    the exception's message."""
    if getattr(exc, 'errno', None):
        return os.strerror(exc.errno)
    quoted = re.search(r"error message = '([^']*)'", str(exc))
    if quoted:
        return quoted.group(1)
    text = ' '.join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (KeyError, TypeError, AttributeError)):
        text = '%s: %s' % (type(exc).__name__, text)
    return text if len(text) <= 120 else text[:117] + '...'


@contextlib.contextmanager
def reading(path, what, error=CaffeError):
    """h5py's failures inside, as ``error("<path> is not a readable <what>: <reason>")``."""
    try:
        yield
    except FAILURES as exc:
        raise error('%s is not a readable %s: %s' % (path, what, reason(exc))) from None


@contextlib.contextmanager
def writing(path):
    """An h5py.File to fill, written to ``path`` atomically when the block ends.

    The file is built in memory (one more copy of what it holds) and then written by
    Python. libhdf5 never meets a failing write itself: a full disk or a file size limit
    would leave its objects half closed, to print tracebacks at exit or crash the process,
    where Python's write fails with one clean error.
    """
    import h5py
    image = io.BytesIO()
    with h5py.File(image, 'w') as f:
        yield f
    with atomic_write(path) as out:
        out.write(image.getbuffer())


def read_dataset(dataset, where):
    """The numbers a dataset holds, once its type (float or integer, as Caffe reads) and
    declared size (within the memory limit) are checked; ``where`` names it in errors."""
    if dataset.dtype.kind not in 'fiu':
        raise CaffeError('%s holds %s values, not numbers' % (where, dataset.dtype))
    size = data_bytes(dataset.shape, dataset.dtype)
    if size > memory_limit():
        raise CaffeError('%s declares shape %s, %s: more than the memory limit'
                         % (where, list(dataset.shape), format_bytes(size)))
    return dataset[()]
