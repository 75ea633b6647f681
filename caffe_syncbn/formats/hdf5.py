"""HDF5 files that may be damaged, or may not fit on the disk.

libhdf5's failures on a damaged file reach Python as any of several exception types,
depending on the structure the damage hit, with messages that run over several lines.
``reading(path, what)`` turns them into one CaffeError line naming the file, and
``read_dataset`` checks a dataset's type and declared size before reading it, so a
damaged header cannot ask for terabytes. ``writing(path)`` writes atomically, and cleanly
when the disk is full.

A file may also keep a dataset's values in other files: external storage (raw bytes of
any file), virtual datasets (datasets of other HDF5 files) and external links. libhdf5
opens those files when the values are read or the name is looked up, so that any file the
user can read would load as weights or data, and a FIFO would block the reader for good.
``refuse_other_files`` turns such a file away before anything in it is read.
"""
import contextlib
import io
import os
import re

from ..blob import data_bytes, format_bytes, memory_limit
from ..errors import CaffeError, name_list, quote
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


def other_files(f):
    """Why the open h5py File ``f`` would read other files, in one phrase: its first
    external (or user-defined) link, or dataset with external storage or virtual; None
    where it holds all its values itself. libhdf5's walks (H5Lvisit, H5Ovisit) go down
    hard links only, and each dataset is opened by a path of hard links, so nothing
    outside ``f`` is opened on the way."""
    import h5py
    links, objects = [], []     # the walks only list: an exception in their callback is lost
    f.id.links.visit(lambda name, info: links.append((name, info.type)), info=True)
    for raw_name, kind in links:
        name = raw_name.decode('utf-8', 'surrogateescape')
        if kind == h5py.h5l.TYPE_EXTERNAL:
            link = f.get(raw_name, getlink=True)
            return '%s is an external link to %s in %s' % (quote(name), quote(link.path),
                                                          quote(link.filename))
        if kind not in (h5py.h5l.TYPE_HARD, h5py.h5l.TYPE_SOFT):
            return '%s is a user-defined link (type %d)' % (quote(name), kind)
    h5py.h5o.visit(f.id, lambda name, info: objects.append((name, info.type)), info=True)
    for raw_name, kind in objects:
        if kind != h5py.h5o.TYPE_DATASET:
            continue
        name = raw_name.decode('utf-8', 'surrogateescape')
        plist = h5py.h5d.open(f.id, raw_name).get_create_plist()
        if plist.get_layout() == h5py.h5d.VIRTUAL:
            sources = {plist.get_virtual_filename(i) for i in range(plist.get_virtual_count())}
            return 'dataset %s is virtual: its values are in %s' % (
                quote(name), name_list(sorted(sources), 80))
        if plist.get_external_count():
            return 'dataset %s keeps its values in %s (external storage)' % (
                quote(name), quote(plist.get_external(0)[0]))
    return None


def other_files_refusal(f, path):
    """The one line that turns the open h5py File ``f`` away, naming it ``path``, where it
    would read other files (see ``other_files``); None where it holds its own values."""
    found = other_files(f)
    return found and '%s: %s, which is refused: an HDF5 file must hold its own values' % (
        path, found)


def refuse_other_files(f, path, error=CaffeError):
    """Raise ``error(other_files_refusal(f, path))`` where there is one."""
    refusal = other_files_refusal(f, path)
    if refusal:
        raise error(refusal)
