"""ThreadComm: a communicator group for the threads of one process, over numpy arrays.

    comms = ThreadComm.create(4)      # give comms[r] to the thread of replica r

Every collective is a meeting of all members (rendezvous.py): sums are taken in rank
order, so every member gets bitwise the same result whatever the thread timing; a
mismatch, an abort or a member that stops coming fails every member at once.
"""
import numpy as np

from .rendezvous import DEFAULT_TIMEOUT, Group, GroupMember


class ThreadComm(GroupMember):
    """One member of a group of threads; build the group with ``ThreadComm.create(n)``."""

    @classmethod
    def create(cls, size, timeout=DEFAULT_TIMEOUT):
        group = Group(size, timeout)
        return [cls(group, rank) for rank in range(size)]

    def allreduce(self, array, tag=None):
        return self.in_order(self.allreduce_host, _host_array(array), tag)

    def allreduce_async(self, array, tag=None):
        return self.in_order_async(self.allreduce_host, _host_array(array), tag)

    def broadcast(self, array, root=0, tag=None):
        if not 0 <= root < self.size:
            raise ValueError('broadcast root %d out of range for %d members' % (root, self.size))
        return self.in_order(self.broadcast_host, _host_array(array), root, tag)


def _host_array(array):
    if not isinstance(array, np.ndarray):
        raise TypeError('ThreadComm works on numpy arrays, got %s' % type(array).__name__)
    return array
