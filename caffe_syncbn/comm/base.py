"""The Communicator: what joins the replicas of a data-parallel run.

Every replica holds one member communicator of a group of ``size`` members and
calls the same collectives in the same order. A collective carries a short
``tag`` naming its caller (a layer name, 'gradients', ...); members compare the
op, tag, shape, dtype and iteration of each collective, and if they differ (a layer run on
only some replicas, collectives issued in different orders) EVERY member raises
``CollectiveMismatch`` naming what each replica called, instead of deadlocking.

Once a member is aborted (``abort(exc)``, called by the device pool when a
replica raises), every member waiting in a collective, or entering one later,
raises ``CommAborted`` promptly.

The interface is small so that it fits threads (ThreadComm), NCCL (stream-ordered:
``allreduce_async`` enqueues, ``wait`` orders the caller after it) and MPI.
"""
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
    #: the solver's iteration, set on every member before each pass (None outside a
    #: solver): members compare it with each call, so one a whole iteration apart fails
    iteration = None

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

    def share_order_with(self, other):
        """Run this member's collectives in one order with those of ``other``, a member of
        another communicator on the same device (a SyncBN group's and all replicas'): where
        the device runs collectives of its own (NCCL's kernels), two communicators that each
        wait for their peers could otherwise wait on each other. Nothing to do elsewhere."""

    def close(self):
        """Release what this member holds for async collectives (helper threads)."""
