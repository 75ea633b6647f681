"""CountingComm: a communicator member that records its calls, for tests that count
collectives."""
import collections
import threading

from caffe_syncbn.comm import Communicator


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
