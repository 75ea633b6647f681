"""One run per snapshot prefix: a lock file beside the snapshots.

Two runs with one ``snapshot_prefix`` write the same file names: the later run's
snapshots replace the earlier's, and the first run's can all be gone. So the process that
writes snapshots holds ``<prefix>.lock``: an advisory lock (flock) on the file, which
holds this process's id and host. The kernel drops the lock when the process ends,
however it ends, so the lock is the truth and the id only names the holder: a killed
run's file is taken over by the next run, with a warning naming the process that left it,
and a live run's is never taken (a process id may have been given to another process
since; a lock cannot be). A clean end (the solver closed or collected, the interpreter's
exit) removes the file.

Solvers of one process share its hold on a prefix (pycaffe scripts build one solver after
another with one solver file); the file goes when the last of them lets go.
"""
import collections
import contextlib
import errno
import fcntl
import logging
import os
import socket
import threading
import weakref

from ..errors import CaffeError, quote

log = logging.getLogger('caffe_syncbn')

LOCK_SUFFIX = '.lock'

#: {lock file path: [open descriptor, holders in this process, owner pid]}
_HELD = {}
_TABLE = threading.Lock()
#: the holds of collected PrefixLocks that found the table in use: a finalizer runs at any
#: allocation, also inside _take on the same thread (while it logs), where waiting for the
#: table would never end; they let go as the table is next given back
_COLLECTED = collections.deque()


class PrefixLock:
    """A solver's hold on the prefix it snapshots at: ``take(prefix)`` before snapshots
    are written, ``release()`` when done (also when the lock is collected, or at exit);
    another run that asks for the prefix meanwhile is refused."""

    def __init__(self):
        self._taken = []                     # the lock file this hold counts in, once taken
        weakref.finalize(self, _let_go_collected, self._taken)

    def take(self, prefix):
        """None once this process holds ``prefix``, or the one line saying which process
        does and how to go on."""
        path = lock_path(prefix)
        if self._taken == [path]:
            return None
        self.release()
        problem = _take(path, prefix)
        if problem is None:
            self._taken.append(path)
        return problem

    def hold(self, prefix, source):
        """``take(prefix)``, its problem raised as a CaffeError naming ``source``."""
        problem = self.take(prefix)
        if problem:
            raise CaffeError('%s: %s' % (source, problem))

    def release(self):
        _let_go(self._taken)


def lock_path(prefix):
    """The lock file of ``prefix``, with its folder resolved, so that one process's names
    for a folder (a relative path, a link) lead to one entry."""
    folder, name = os.path.split(os.path.abspath(prefix + LOCK_SUFFIX))
    return os.path.join(os.path.realpath(folder), name)


@contextlib.contextmanager
def _table():
    """The table, held; the holds collected meanwhile let go before it is given back."""
    with _TABLE:
        yield
        while _COLLECTED:
            _count_down(_COLLECTED.popleft())


def _take(path, prefix):
    with _table():
        held = _HELD.get(path)
        if held is not None and held[2] == os.getpid():
            held[1] += 1
            return None
        for _ in range(100):       # the holder may remove the file between our open and lock
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                return 'cannot create the lock file %s of snapshot prefix %s: %s' % (
                    quote(path), quote(prefix), exc.strerror)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                return ('snapshot prefix %s is in use by %s (lock file %s): two runs with one '
                        "prefix overwrite each other's snapshots; give this run another "
                        'snapshot_prefix, or end that one' % (quote(prefix), holder, quote(path)))
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    return 'cannot lock %s, the lock file of snapshot prefix %s: %s' % (
                        quote(path), quote(prefix), exc.strerror)
                log.warning('Cannot lock %s (%s): another run with snapshot prefix %s would '
                            'not be noticed', quote(path), exc.strerror, quote(prefix))
                return None
            if not _still_named(fd, path):
                os.close(fd)
                continue
            left = _holder(fd, None)
            if left is not None:
                log.warning('Took over the lock file %s of snapshot prefix %s from %s, which '
                            'ended without removing it', quote(path), quote(prefix), left)
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, ('%d %s\n' % (os.getpid(), socket.gethostname())).encode(), 0)
            except OSError as exc:             # a full disk, a file size limit
                os.close(fd)
                return 'cannot write the lock file %s of snapshot prefix %s: %s' % (
                    quote(path), quote(prefix), exc.strerror)
            _HELD[path] = [fd, 1, os.getpid()]
            return None
        return 'cannot take the lock file %s of snapshot prefix %s: it keeps being replaced' % (
            quote(path), quote(prefix))


def _let_go(taken):
    """Count down the holders of each lock file in ``taken`` (and empty it); the last one
    of this process removes the file."""
    with _table():
        _count_down(taken)


def _let_go_collected(taken):
    """_let_go for a collected PrefixLock: now if the table is free, else as it is given
    back (_COLLECTED)."""
    if not _TABLE.acquire(blocking=False):
        _COLLECTED.append(taken)
        return
    try:
        _count_down(taken)
    finally:
        _TABLE.release()


def _count_down(taken):
    """_let_go's work, with the table held."""
    for path in taken:
        held = _HELD.get(path)
        if held is None or held[2] != os.getpid():     # a forked child holds nothing
            continue
        held[1] -= 1
        if held[1] == 0:
            del _HELD[path]
            fd = held[0]
            if _still_named(fd, path):    # while locked: a run that opened it retries
                with contextlib.suppress(OSError):
                    os.remove(path)
            os.close(fd)
    del taken[:]


def _still_named(fd, path):
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        named, opened = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _holder(fd, unknown='another process'):
    """'process 1234 on this machine' or 'process 1234 on host gpu7', from a lock file's
    text; ``unknown`` where it holds none (being written, or damaged)."""
    fields = os.pread(fd, 300, 0).decode('utf-8', 'replace').split()
    if len(fields) != 2 or not fields[0].isdigit():
        return unknown
    where = 'this machine' if fields[1] == socket.gethostname() else 'host %s' % quote(fields[1])
    return 'process %s on %s' % (fields[0], where)
