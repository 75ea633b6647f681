"""ThreadComm: a communicator group for the threads of one process, over numpy arrays.

    comms = ThreadComm.create(4)      # give comms[r] to the thread of replica r

Every collective is a rendezvous of all members under one Condition. Sums are
taken in rank order (((a0 + a1) + a2) + ...), so every member gets bitwise the
same result, whatever the thread timing. Small arrays are summed once by the last
member to arrive; large ones are summed in parallel, each member taking one slice
of the result (elementwise, so the order and the bits are the same).

Waiting members wake at once when the group fails: ``abort(exc)`` from any member
(or from the device pool), a mismatch of collectives, or a rendezvous that times
out (``timeout`` seconds, a backstop for a replica that stopped issuing
collectives without failing). A failed group stays failed.

``allreduce_async`` runs on a helper thread per member, started on first use; all
of a member's collectives, async or blocking, run in the order they were issued,
as on one NCCL stream.
"""
import queue
import threading
import time

import numpy as np

from ..backend.thread_start import start_thread
from .base import CollectiveMismatch, CommAborted, Communicator, Handle

DEFAULT_TIMEOUT = 300.0
#: arrays with at least this many elements are summed by all members in parallel
PARALLEL_SUM_MIN_SIZE = 1 << 16


class _Call:
    """What one member asked for at one collective."""
    __slots__ = ('op', 'tag', 'array', 'root')

    def __init__(self, op, tag, array=None, root=None):
        self.op, self.tag, self.array, self.root = op, tag, array, root

    def signature(self):
        if self.array is None:
            return (self.op, self.tag, None, None, self.root)
        return (self.op, self.tag, self.array.shape, self.array.dtype.str, self.root)

    def describe(self):
        text = '%s %r' % (self.op, self.tag)
        if self.array is not None:
            text += ' (%s, shape %s)' % (self.array.dtype.name, self.array.shape)
        if self.root is not None:
            text += ' root %d' % self.root
        return text


def _mismatch(calls):
    """None if every member called the same collective, else a message naming each call."""
    if all(c.signature() == calls[0].signature() for c in calls):
        return None
    listing = '; '.join('replica %d called %s' % (r, c.describe()) for r, c in enumerate(calls))
    return ('replicas issued different collectives at the same point (%s). A layer that runs on '
            'only some replicas, or collectives issued in a different order, cause this' % listing)


class _Group:
    """The state the members of one ThreadComm group share."""

    def __init__(self, size, timeout):
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self._calls = [None] * size
        self._published = None
        self._failure = None          # (exception class, message, cause) once failed

    def fail(self, cls, message, cause=None):
        with self._cond:
            if self._failure is None:
                self._failure = (cls, message, cause)
            self._cond.notify_all()

    def _raise(self, rank, call):
        cls, message, cause = self._failure
        raise cls('%s [replica %d, in %s]' % (message, rank, call.describe())) from cause

    def rendezvous(self, rank, call, complete=None):
        """Wait for every member's call; the last to arrive checks that they match and
        publishes ``complete(calls)`` (or the calls), which every member gets back."""
        with self._cond:
            if self._failure is not None:
                self._raise(rank, call)
            generation = self._generation
            self._calls[rank] = call
            self._arrived += 1
            if self._arrived == self.size:
                calls, self._calls = self._calls, [None] * self.size
                self._arrived = 0
                self._generation += 1
                message = _mismatch(calls)
                if message is not None:
                    self._failure = (CollectiveMismatch, message, None)
                else:
                    try:
                        self._published = complete(calls) if complete else calls
                    except Exception as exc:
                        self._failure = (CommAborted, 'collective failed: %r' % exc, exc)
                self._cond.notify_all()
            deadline = time.monotonic() + self.timeout
            while self._generation == generation and self._failure is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [r for r, c in enumerate(self._calls) if c is None]
                    self._failure = (CommAborted, 'timed out after %g s waiting for replica(s) %s '
                                     'to join the collective' % (self.timeout, missing), None)
                    self._cond.notify_all()
                    break
                self._cond.wait(remaining)
            if self._failure is not None:
                self._raise(rank, call)
            return self._published


def _sum_in_rank_order(calls):
    total = calls[0].array.copy()
    for call in calls[1:]:
        total += call.array
    return total


def _calls_and_output(calls):
    return calls, np.empty_like(calls[0].array)


class GroupMember(Communicator):
    """What the members of an in-process group share: the rendezvous ``_Group`` (barrier,
    abort) and a helper thread that runs this member's async collectives in order."""

    def __init__(self, group, rank):
        self._group = group
        self.size = group.size
        self.rank = rank
        self._helper = None           # runs async collectives, started on first use
        self._last_async = None

    def barrier(self, tag=None):
        self._in_order(self._group.rendezvous, self.rank, _Call('barrier', tag))

    def abort(self, exc):
        self._group.fail(CommAborted, 'collectives aborted because a replica failed: %r' % (exc,),
                         exc)

    def close(self):
        """Stop the helper thread of async collectives (if any)."""
        if self._helper is not None:
            self._helper.stop()
            self._helper = None

    def _submit_async(self, fn, *args):
        """Queue a collective on the helper thread; its handle is the member's latest."""
        if self._helper is None:
            self._helper = _Helper('%s-%d' % (type(self).__name__, self.rank))
        self._last_async = self._helper.submit(fn, *args)
        return self._last_async

    def _in_order(self, fn, *args):
        """Run a blocking collective after this member's pending async ones."""
        pending = self._last_async
        if pending is not None and not pending.done():
            return self._helper.submit(fn, *args).wait()
        return fn(*args)


def new_group(size, timeout):
    if size < 1:
        raise ValueError('a communicator group needs at least 1 member, got %d' % size)
    return _Group(int(size), float(timeout))


class ThreadComm(GroupMember):
    """One member of a group of threads; build the group with ``ThreadComm.create(n)``."""

    @classmethod
    def create(cls, size, timeout=DEFAULT_TIMEOUT):
        group = new_group(size, timeout)
        return [cls(group, rank) for rank in range(size)]

    # ---- collectives -------------------------------------------------------------------
    def allreduce(self, array, tag=None):
        return self._in_order(self._allreduce, _host_array(array), tag)

    def allreduce_async(self, array, tag=None):
        return self._submit_async(self._allreduce, _host_array(array), tag)

    def broadcast(self, array, root=0, tag=None):
        if not 0 <= root < self.size:
            raise ValueError('broadcast root %d out of range for %d members' % (root, self.size))
        return self._in_order(self._broadcast, _host_array(array), root, tag)

    # ---- implementation ----------------------------------------------------------------
    def _allreduce(self, array, tag):
        call = _Call('allreduce', tag, array)
        if array.size < PARALLEL_SUM_MIN_SIZE:
            array[...] = self._group.rendezvous(self.rank, call, _sum_in_rank_order)
            return array
        calls, total = self._group.rendezvous(self.rank, call, _calls_and_output)
        step = -(-array.size // self.size)
        part = slice(self.rank * step, min(array.size, (self.rank + 1) * step))
        out = total.reshape(-1)[part]
        out[...] = calls[0].array.reshape(-1)[part]
        for other in calls[1:]:
            out += other.array.reshape(-1)[part]
        self._group.rendezvous(self.rank, _Call('allreduce (summed)', tag))
        array[...] = total
        return array

    def _broadcast(self, array, root, tag):
        calls = self._group.rendezvous(self.rank, _Call('broadcast', tag, array, root))
        if self.rank != root:
            array[...] = calls[root].array
        # the root's array must stay untouched until every member has copied it
        self._group.rendezvous(self.rank, _Call('broadcast (copied)', tag))
        return array


def _host_array(array):
    if not isinstance(array, np.ndarray):
        raise TypeError('ThreadComm works on numpy arrays, got %s' % type(array).__name__)
    return array


class _FutureHandle(Handle):
    def __init__(self):
        self._event = threading.Event()
        self._result = None
        self._error = None

    def _finish(self, result=None, error=None):
        self._result, self._error = result, error
        self._event.set()

    def done(self):
        return self._event.is_set()

    def wait(self, timeout=None):
        if not self._event.wait(timeout):
            raise CommAborted('async collective did not complete within %g s' % timeout)
        if self._error is not None:
            raise self._error
        return self._result


class _Helper:
    """One daemon thread running submitted collectives in order."""

    def __init__(self, name):
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        start_thread(self._thread, "the collectives' helper thread %s" % name)

    def submit(self, fn, *args):
        handle = _FutureHandle()
        self._queue.put((fn, args, handle))
        return handle

    def stop(self, timeout=5.0):
        """Finish the queued collectives and end the thread (an aborted group fails them
        promptly, so the join is short)."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, handle = item
            try:
                handle._finish(result=fn(*args))
            except BaseException as exc:      # handed to the waiting caller
                handle._finish(error=exc)
