"""Atomic file writes: a reader sees the old file or the complete new one, never half of one.

The data goes to a temporary file in the target's folder (same file system, so the final
``os.replace`` is an atomic rename) and replaces the target only when writing succeeded.
The file is synced before the rename and its folder after it: a rename lives in the
folder, so without the second sync a power loss could lose a file reported as written.
The temporary file is named ``.<target name>.<pid>.<random>.tmp``: a process killed while
writing leaves it behind, and ``remove_stale_temporaries`` removes those of processes that
are gone. A failed write is a CaffeError that names the target and the system's reason.
"""
import contextlib
import errno
import glob
import os
import re
import tempfile

from ..errors import CaffeError

# The mode a plainly created file would get; mkstemp's private 0600 would hide
# weights and snapshots from the other users of a shared machine.
_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_write(path):
    """Write ``path`` atomically: yields a binary file object open for writing. On an
    exception the temporary file is removed and ``path`` is left untouched; an OSError
    (a full disk, a file size limit, a missing folder) becomes a CaffeError naming
    ``path``. (HDF5 files are written with ``hdf5.writing``, which uses this.)
    """
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix='.%s.%d.' % (name, os.getpid()), suffix='.tmp',
                                   dir=folder)
        with os.fdopen(fd, 'wb') as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
        tmp = None
        _sync_folder(folder)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        if isinstance(exc, OSError):
            raise CaffeError('cannot write %s: %s' % (path, exc.strerror or exc)) from None
        raise


def _sync_folder(folder):
    """fsync a folder, so that the renames in it are on the disk. A file system that
    cannot sync a folder says EINVAL; there is nothing more to do on it."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, 'O_DIRECTORY', 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def remove_stale_temporaries(prefix):
    """Remove the temporary files that writes of files whose names start with ``prefix``
    (a path and the start of a name) left behind when their process died. Files of live
    processes, and every complete file, are left alone. Returns the paths removed."""
    folder, start = os.path.split(os.path.abspath(prefix))
    removed = []
    for path in glob.glob(os.path.join(glob.escape(folder), '.%s*.tmp' % glob.escape(start))):
        match = _TEMPORARY.match(os.path.basename(path))
        if match is None or _alive(match.group('pid')):
            continue
        with contextlib.suppress(OSError):
            os.remove(path)
            removed.append(path)
    return removed


# .<name>.<pid>.<8 random characters>.tmp, or from earlier versions, without the pid
_TEMPORARY = re.compile(r'^\..+?\.(?:(?P<pid>\d+)\.)?[a-z0-9_]{8}\.tmp$')


def _alive(pid):
    if pid is None:
        return False
    pid = int(pid)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True            # it exists, under another user
    return True
