"""The rendezvous: what every in-process communicator group builds on.

    group = Group(4)                          # the members' meeting point
    class MyComm(GroupMember): ...            # comms = [MyComm(group, k) for k in range(4)]

A collective is a meeting of all members of a ``Group``: each brings a ``Call`` (the op,
its tag and array), the last to arrive compares them and computes the result once, and
every member gets it back. Calls that differ (a layer run on only some replicas,
collectives issued in different orders) fail the group with CollectiveMismatch naming
what each replica called, instead of a deadlock.

Each call carries the member's ``iteration`` (the solver's, set before each pass; None
outside a solver), so that a member a whole iteration behind or ahead fails as a mismatch
too. Groups that span processes compare each call across them as well before the
collective runs (``compare_across``: a fixed-size record of it from every process, in one
non-blocking allgather), so a process that skipped a layer or ran another fails every
process at once with one line naming what each called, instead of waiting for a timeout.

Waiting members wake at once when the group fails: ``abort(exc)`` from any member (or
from the device pool), a mismatch, or a meeting that times out (``timeout`` seconds, a
backstop for a replica that stopped issuing collectives without failing). A failed group
stays failed.

``GroupMember`` is the base of the communicators whose members meet here (ThreadComm,
SameDeviceComm, ProcessGroupComm): barrier and abort, the sums of host arrays in rank
order (((a0 + a1) + a2) + ..., so every member gets bitwise the same result, whatever the
thread timing), and a helper thread per member that runs its ``allreduce_async`` calls:
all of a member's collectives, async or blocking, run in the order they were issued, as
on one NCCL stream. NcclComm meets here too, to compare its calls before NCCL runs them.
"""
import hashlib
import queue
import threading
import time

import numpy as np

from ..backend.thread_start import start_thread
from .base import CollectiveMismatch, CommAborted, Communicator, Handle

DEFAULT_TIMEOUT = 300.0
#: host arrays with at least this many elements are summed by all members in parallel
PARALLEL_SUM_MIN_SIZE = 1 << 16
#: the bytes of one call's record in the comparison across processes: a digest of its
#: signature, then its description (cut to fit) for the message
RECORD_BYTES, DIGEST_BYTES = 256, 8


class Call:
    """What one member asked for at one collective; subclasses carry more (a stream, an
    event, a scalar) for the member that completes the meeting."""
    __slots__ = ('op', 'tag', 'array', 'root', 'iteration')

    def __init__(self, op, tag, array=None, root=None):
        self.op, self.tag, self.array, self.root = op, tag, array, root
        self.iteration = None

    def signature(self):
        if self.array is None:
            return (self.op, self.tag, None, None, self.root, self.iteration)
        return (self.op, self.tag, self.array.shape, self.array.dtype.str, self.root,
                self.iteration)

    def describe(self):
        text = '%s %r' % (self.op, self.tag)
        if self.array is not None:
            text += ' (%s, shape %s)' % (self.array.dtype.name, self.array.shape)
        if self.root is not None:
            text += ' root %d' % self.root
        if self.iteration is not None:
            text += ' at iteration %d' % self.iteration
        return text

    def record(self):
        """This call as RECORD_BYTES bytes, for compare_across."""
        digest = hashlib.blake2b(repr(self.signature()).encode(), digest_size=DIGEST_BYTES)
        text = self.describe().encode('utf-8', 'replace')[:RECORD_BYTES - DIGEST_BYTES]
        return digest.digest() + text.ljust(RECORD_BYTES - DIGEST_BYTES, b'\0')


class ValueCall(Call):
    """A call that brings a host scalar (``allreduce_scalar``)."""
    __slots__ = ('value',)

    def __init__(self, op, tag, value):
        super().__init__(op, tag)
        self.value = value


def sum_values(calls):
    """The sum of the calls' scalars, in rank order."""
    total = 0.0
    for call in calls:
        total += call.value
    return total


def sum_arrays(calls):
    """The sum of the calls' arrays, in rank order, as a new array. Sums that overflow or
    meet inf - inf are the solver's to find and name (-nan_effect, a float16 loss scale's
    skipped update), not numpy's warning, outside the log."""
    total = calls[0].array.copy()
    with np.errstate(over='ignore', invalid='ignore'):
        for call in calls[1:]:
            total += call.array
    return total


def compare_across(link, call):
    """Raise CollectiveMismatch, on every process of ``link`` alike, unless each of them is
    at the same ``call`` (op, tag, shape, dtype, root, iteration): one exchange of the
    calls' records (``link.allgather_bytes``) before the collective runs, so a mismatch
    ends the collective in every process at once, named, and arrays of different sizes
    never meet."""
    records = link.allgather_bytes(call.record())
    if all(r[:DIGEST_BYTES] == records[0][:DIGEST_BYTES] for r in records):
        return
    callers = {}
    for process, record in enumerate(records):
        text = record[DIGEST_BYTES:].rstrip(b'\0').decode('utf-8', 'replace')
        callers.setdefault(text, []).append(process)
    listing = '; '.join('process%s %s called %s' % ('es' if len(ps) > 1 else '',
                                                    ', '.join(map(str, ps)), text)
                        for text, ps in callers.items())
    raise CollectiveMismatch('processes issued different collectives at the same point (%s). '
                             'A layer that runs in only some processes, or collectives issued '
                             'in a different order, cause this' % listing)


def _mismatch(calls):
    """None if every member called the same collective, else a message naming each call."""
    if all(c.signature() == calls[0].signature() for c in calls):
        return None
    listing = '; '.join('replica %d called %s' % (r, c.describe()) for r, c in enumerate(calls))
    return ('replicas issued different collectives at the same point (%s). A layer that runs on '
            'only some replicas, or collectives issued in a different order, cause this' % listing)


class Group:
    """The meeting point the ``size`` members of one group share (see the module
    docstring)."""

    def __init__(self, size, timeout=DEFAULT_TIMEOUT):
        if size < 1:
            raise ValueError('a communicator group needs at least 1 member, got %d' % size)
        self.size = int(size)
        self.timeout = float(timeout)
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self._calls = [None] * self.size
        self._published = None
        self._failure = None          # (exception class, message, cause) once failed

    def fail(self, cls, message, cause=None):
        with self._cond:
            if self._failure is None:
                self._failure = (cls, message, cause)
            self._cond.notify_all()

    def _raise(self, index, call):
        cls, message, cause = self._failure
        raise cls('%s [replica %d, in %s]' % (message, index, call.describe())) from cause

    def rendezvous(self, index, call, complete=None):
        """Wait for every member's call (``index`` is this member's place in the group);
        the last to arrive checks that they match and publishes ``complete(calls)`` (or
        the calls), which every member gets back."""
        with self._cond:
            if self._failure is not None:
                self._raise(index, call)
            generation = self._generation
            self._calls[index] = call
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
                    except CollectiveMismatch as exc:     # across processes: its own line
                        self._failure = (CollectiveMismatch, str(exc), None)
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
                self._raise(index, call)
            return self._published


def _calls_and_output(calls):
    # C order whatever the input's: the slices below write through a flat view of it
    return calls, np.empty(calls[0].array.shape, calls[0].array.dtype)


class GroupMember(Communicator):
    """One member of a ``Group``, at place ``index`` (its rank, unless a subclass says
    otherwise). Subclasses implement the collectives on top of ``meet``, run them through
    ``in_order`` (blocking) or ``in_order_async`` (a Handle), and may use the host sums
    ``allreduce_host`` and ``broadcast_host``."""

    def __init__(self, group, index):
        self.group = group
        self.index = index
        self.size = group.size
        self.rank = index
        self._helper = None           # runs async collectives, started on first use
        self._last_async = None

    def meet(self, call, complete=None):
        """This member's part of a meeting of the group (Group.rendezvous), at its
        ``iteration``."""
        call.iteration = self.iteration
        return self.group.rendezvous(self.index, call, complete)

    def barrier(self, tag=None):
        self.in_order(self.meet, Call('barrier', tag))

    def abort(self, exc):
        self.group.fail(CommAborted, 'collectives aborted because a replica failed: %r' % (exc,),
                        exc)

    def close(self):
        """Stop the helper thread of async collectives (if any)."""
        if self._helper is not None:
            self._helper.stop()
            self._helper = None

    # ---- for the collectives of subclasses -----------------------------------------------
    def in_order_async(self, fn, *args):
        """Queue ``fn(*args)`` on this member's helper thread; its Handle is the member's
        latest."""
        if self._helper is None:
            self._helper = _Helper('%s-%d' % (type(self).__name__, self.rank))
        self._last_async = self._helper.submit(fn, *args)
        return self._last_async

    def in_order(self, fn, *args):
        """Run a blocking collective ``fn(*args)`` after this member's pending async ones."""
        pending = self._last_async
        if pending is not None and not pending.done():
            return self._helper.submit(fn, *args).wait()
        return fn(*args)

    def allreduce_host(self, array, tag):
        """Sum a host array over the group in place, in rank order. Small arrays are summed
        once by the last member to arrive; large ones by all members in parallel, each
        taking one slice of the result (elementwise, so the order and the bits are the
        same)."""
        call = Call('allreduce', tag, array)
        if array.size < PARALLEL_SUM_MIN_SIZE:
            array[...] = self.meet(call, sum_arrays)
            return array
        calls, total = self.meet(call, _calls_and_output)
        step = -(-array.size // self.size)
        part = slice(self.index * step, min(array.size, (self.index + 1) * step))
        out = total.reshape(-1)[part]
        out[...] = calls[0].array.reshape(-1)[part]
        with np.errstate(over='ignore', invalid='ignore'):       # as in sum_arrays
            for other in calls[1:]:
                out += other.array.reshape(-1)[part]
        self.meet(Call('allreduce (summed)', tag))
        array[...] = total
        return array

    def broadcast_host(self, array, root, tag):
        """Copy member ``root``'s host array into every member's, in place."""
        calls = self.meet(Call('broadcast', tag, array, root))
        if self.index != root:
            array[...] = calls[root].array
        # the root's array must stay untouched until every member has copied it
        self.meet(Call('broadcast (copied)', tag))
        return array


class _FutureHandle(Handle):
    def __init__(self):
        self._event = threading.Event()
        self._result = None
        self._error = None

    def finish(self, result=None, error=None):
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
                handle.finish(result=fn(*args))
            except BaseException as exc:      # handed to the waiting caller
                handle.finish(error=exc)
