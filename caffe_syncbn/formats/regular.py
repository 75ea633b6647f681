"""Every reader checks its file here before opening it: only a regular file is read.

Opening a FIFO (or ``/dev/stdin``, a pipe or a terminal) waits for a writer and reading a
device may never end, so a path to one in a prototxt, a list or a solverstate would hang
the run. Such a path is one error that says what it names instead.
"""
import os
import stat

from ..errors import CaffeError, quote

_KINDS = [(stat.S_ISDIR, 'a folder'), (stat.S_ISFIFO, 'a FIFO'),
          (stat.S_ISCHR, 'a character device'), (stat.S_ISBLK, 'a block device'),
          (stat.S_ISSOCK, 'a socket')]


def not_regular(path):
    """What ``path`` names where that is not a regular file ('a FIFO', 'a folder', ...),
    else None: for a regular file, and for a path that names nothing (the reader's own
    message for a missing file says more)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):           # ValueError: a NUL in the name
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), 'a special file')


def require_regular(path, what='', error=CaffeError):
    """``path``, unless it names something other than a regular file: then
    ``error("<what> <path> is not a regular file (a FIFO)")``."""
    kind = not_regular(path)
    if kind is not None:
        raise error('%s%s is not a regular file (%s)'
                    % (what + ' ' if what else '', quote(path, quotes=False), kind))
    return path
