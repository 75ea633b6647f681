"""SoloComm: the communicator of a run with one replica, on any device.

With one member every collective is the identity, so nothing is exchanged, no thread
waits and no library is needed: one GPU trains without NCCL, one CPU device without a
rendezvous. A collective after ``abort`` still raises, as in every group.
"""
from .base import CommAborted, Communicator


class SoloComm(Communicator):
    """The only member of its group (size 1, rank 0)."""

    def __init__(self):
        self._aborted = None

    @classmethod
    def create(cls, size=1):
        if size != 1:
            raise ValueError('SoloComm has one member, not %d' % size)
        return [cls()]

    def _check(self, what):
        if self._aborted is not None:
            raise CommAborted('%s after the run was aborted' % what) from self._aborted

    def allreduce(self, array, tag=None):
        self._check('allreduce')
        return array

    def broadcast(self, array, root=0, tag=None):
        if root != 0:
            raise ValueError('broadcast root %d out of range for 1 member' % root)
        self._check('broadcast')
        return array

    def barrier(self, tag=None):
        self._check('barrier')

    def abort(self, exc):
        self._aborted = exc
