"""The Communicator: what joins the replicas of a data-parallel run.

Every replica holds one member communicator of a group of ``size`` members and
calls the same collectives in the same order. A collective carries a short
``tag`` naming its caller (a layer name, 'gradients', ...); members compare the
op, tag, shape and dtype of each collective, and if they differ (a layer run on
only some replicas, collectives issued in different orders) EVERY member raises
``CollectiveMismatch`` naming what each replica called, instead of deadlocking.

Once a member is aborted (``abort(exc)``, called by the device pool when a
replica raises), every member waiting in a collective, or entering one later,
raises ``CommAborted`` promptly.

The interface is small so that it fits threads (ThreadComm), NCCL (stream-ordered:
``allreduce_async`` enqueues, ``wait`` orders the caller after it) and MPI.
"""
import collections
import threading

import numpy as np

from ..errors import CaffeError


class CommAborted(CaffeError):
    """A collective could not complete: a member was aborted, failed or timed out."""


class CollectiveMismatch(CaffeError):
    """Replicas issued different collectives at the same point of their sequence."""


class Handle:
    """A pending collective. ``wait()`` blocks until it is done and returns its array;
    it raises the collective's error, if any."""

    def wait(self, timeout=None):
        raise NotImplementedError

    def done(self):
        raise NotImplementedError


class CompletedHandle(Handle):
    """The handle of a collective that already ran."""

    def __init__(self, result):
        self._result = result

    def wait(self, timeout=None):
        return self._result

    def done(self):
        return True


class Communicator:
    """One member of a communicator group (see the module docstring)."""

    size = 1
    rank = 0

    def allreduce(self, array, tag=None):
        """Sum ``array`` over all members, IN PLACE; every member gets bitwise the
        same result. Returns ``array``."""
        raise NotImplementedError

    def allreduce_async(self, array, tag=None):
        """Start an in-place allreduce and return a Handle. ``array`` must not be
        touched until ``wait()`` returns. Collectives run in the order they are
        issued, async or not."""
        return CompletedHandle(self.allreduce(array, tag=tag))

    def broadcast(self, array, root=0, tag=None):
        """Copy ``array`` of member ``root`` into ``array`` of every member, in place."""
        raise NotImplementedError

    def barrier(self, tag=None):
        """Wait until every member has called barrier."""
        raise NotImplementedError

    def allreduce_scalar(self, value, tag=None):
        """The sum of a host scalar over all members, as a float (one float64 allreduce)."""
        buffer = np.array([float(value)], dtype=np.float64)
        return float(self.allreduce(buffer, tag=tag)[0])

    def abort(self, exc):
        """Make every member's pending and future collectives raise CommAborted (cause: exc)."""
        raise NotImplementedError

    def close(self):
        """Release what this member holds for async collectives (helper threads)."""


class CountingComm(Communicator):
    """Wraps a member communicator and records every call as ``(op, tag)`` (for tests).

    ``count('allreduce', tag='bn1')`` counts the blocking allreduce calls tagged
    'bn1'; ``count('allreduce')`` counts them whatever the tag. ``allreduce_async``,
    ``allreduce_scalar``, ``broadcast`` and ``barrier`` are recorded under their
    own names.
    """

    def __init__(self, inner):
        self.inner = inner
        self.calls = []
        self._lock = threading.Lock()

    @property
    def size(self):
        return self.inner.size

    @property
    def rank(self):
        return self.inner.rank

    def _record(self, op, tag):
        with self._lock:
            self.calls.append((op, tag))

    def count(self, op='allreduce', tag=None):
        with self._lock:
            return sum(1 for o, t in self.calls if o == op and (tag is None or t == tag))

    def counts(self):
        """A Counter of (op, tag) over every recorded call."""
        with self._lock:
            return collections.Counter(self.calls)

    def reset(self):
        with self._lock:
            self.calls = []

    def allreduce(self, array, tag=None):
        self._record('allreduce', tag)
        return self.inner.allreduce(array, tag=tag)

    def allreduce_async(self, array, tag=None):
        self._record('allreduce_async', tag)
        return self.inner.allreduce_async(array, tag=tag)

    def broadcast(self, array, root=0, tag=None):
        self._record('broadcast', tag)
        return self.inner.broadcast(array, root=root, tag=tag)

    def barrier(self, tag=None):
        self._record('barrier', tag)
        return self.inner.barrier(tag=tag)

    def allreduce_scalar(self, value, tag=None):
        self._record('allreduce_scalar', tag)
        return self.inner.allreduce_scalar(value, tag=tag)

    def abort(self, exc):
        return self.inner.abort(exc)

    def close(self):
        return self.inner.close()

    def __getattr__(self, name):            # what the wrapped member adds to the interface
        if name == 'inner':
            raise AttributeError(name)
        return getattr(self.inner, name)
