"""Threads started where the process's limits may refuse them.

A thread takes address space for its stack (the soft RLIMIT_STACK, 8 MiB by default);
under an address-space limit (``ulimit -v``, RLIMIT_AS) Python then raises
``RuntimeError: can't start new thread`` wherever the thread happened to start. The
package's threads start when their pools are made, before the first iteration, and a
refusal is one CaffeError naming the thread, the stack it asked for and the limit.
"""
import resource
import threading

from ..errors import CaffeError

#: glibc's stack for a thread when RLIMIT_STACK is unlimited
UNLIMITED_STACK_BYTES = 2 << 20


def mebibytes(count):
    """'8.0 MiB (8388608 bytes)'."""
    return '%.1f MiB (%d bytes)' % (count / (1 << 20), count)


def stack_bytes():
    """The stack a new thread asks for: threading.stack_size, else the soft RLIMIT_STACK."""
    if threading.stack_size():
        return threading.stack_size()
    soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
    return UNLIMITED_STACK_BYTES if soft == resource.RLIM_INFINITY else soft


def _used(field):
    """A field of /proc/self/status in bytes (VmSize, VmData), or None off Linux."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith(field + ':'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


#: the limits that refuse an allocation or a stack: (rlimit, what it counts, its name)
LIMITS = ((resource.RLIMIT_AS, 'VmSize', 'address space (ulimit -v)'),
          (resource.RLIMIT_DATA, 'VmData', 'data (ulimit -d)'))


def room_left():
    """(bytes the process may still map, a phrase naming the limit) under the tightest of
    its address-space and data limits, or None where it has neither (or is not Linux)."""
    rooms = []
    for kind, field, name in LIMITS:
        soft, used = resource.getrlimit(kind)[0], _used(field)
        if soft != resource.RLIM_INFINITY and used is not None:
            rooms.append((soft - used, '%s of its %s limit of %s' % (
                mebibytes(max(0, soft - used)), name, mebibytes(soft))))
    return min(rooms) if rooms else None


def _refused(what, exc):
    room = room_left()
    return CaffeError('cannot start %s: %s; a thread asks for a stack of %s%s' % (
        what, exc, mebibytes(stack_bytes()), ', and the process has %s left' % room[1]
        if room else ''))


def start_thread(thread, what):
    """``thread.start()``, or one CaffeError naming ``what`` (the thread)."""
    try:
        thread.start()
    except RuntimeError as exc:        # "can't start new thread": no room for its stack
        raise _refused(what, exc) from None


def start_workers(executor, count, what):
    """Start ``count`` threads of a ThreadPoolExecutor now, which otherwise starts them as
    work comes, in the middle of a pass; or one CaffeError naming ``what`` (the pool) and
    which of its threads was refused. Each started thread waits until all are there, so
    that none is idle when the next is asked for (an idle one would take its work)."""
    everyone = threading.Barrier(count + 1)
    waiting = []
    try:
        for k in range(count):
            try:
                waiting.append(executor.submit(everyone.wait))
            except RuntimeError as exc:
                raise _refused('thread %d of %d of %s' % (k + 1, count, what), exc) from None
        everyone.wait()
    except BaseException:
        everyone.abort()
        raise
    for started in waiting:
        started.result()
