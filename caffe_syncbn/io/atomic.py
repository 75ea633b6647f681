"""Atomic file writes: a reader sees the old file or the complete new one, never half of one.

The data goes to a temporary file in the target's folder (same file system, so the final
``os.replace`` is an atomic rename) and replaces the target only when writing succeeded.
"""
import contextlib
import os
import tempfile

# The mode a plainly created file would get; mkstemp's private 0600 would hide
# weights and snapshots from the other users of a shared machine.
_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_write(path, as_path=False):
    """Write ``path`` atomically.

    Yields a binary file object open for writing, or with ``as_path=True`` the name of
    the temporary file (for writers such as h5py that open files themselves). On an
    exception the temporary file is removed and ``path`` is left untouched.
    """
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix='.%s.' % name, suffix='.tmp', dir=folder)
    try:
        if as_path:
            os.close(fd)
            yield tmp
        else:
            with os.fdopen(fd, 'wb') as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
