"""SyncBN's groups: the replicas whose batch statistics SyncBN layers share, when not all.

    groups = Groups(counts=[4, 4], size=2)          # 2 processes of 4 replicas, groups of 2
    members = group_communicators(devices, link, groups, first)   # one per local replica

Group g holds the ``size`` consecutive global replicas g*size ... (g+1)*size - 1 (global
ranks count the replicas process by process, in MPI rank order: comm/mpi.py). A group lies
within one process, or is made of whole processes: a group that took part of a process
and part of another would need a communicator over a part of a process's replicas, which
no placement needs (give every process the same number of replicas, and a size that
divides it or is a multiple of it).

A group's communicator is one of the kinds ``communicators`` picks for its devices alone:
threads (ThreadComm), one GPU repeated (SameDeviceComm), distinct GPUs (NCCL), one replica
(SoloComm: per-device batch norm, nothing exchanged). A group of whole processes talks over
a SubLink of those processes alone (MpiLink.split), so a group within a process never
touches MPI, and a group within a node never leaves it. The gradients still go through
the communicators of all replicas; only SyncBN layers use these.
"""
from ..errors import CaffeError
from .for_devices import communicators


def _span(ranks):
    """'4-7' or '4' for consecutive numbers."""
    return '%d' % ranks[0] if len(ranks) == 1 else '%d-%d' % (ranks[0], ranks[-1])


class Groups:
    """Groups of ``size`` consecutive global replicas over processes holding ``counts``
    replicas each (see the module docstring); a size the layout refuses is one CaffeError
    line."""

    def __init__(self, counts, size):
        self.counts, self.size = [int(c) for c in counts], int(size)
        self.total = sum(self.counts)
        self.offsets = [sum(self.counts[:p]) for p in range(len(self.counts))]
        layout = ('%d processes x %s' % (len(counts), '/'.join(map(str, counts)))
                  if len(counts) > 1 else '1 process')
        if self.size < 1 or self.total % self.size:
            raise CaffeError('sync_bn_group_size %d: it must divide the number of replicas, '
                             '%d (%s); divisors: %s'
                             % (self.size, self.total, layout,
                                ', '.join(str(k) for k in range(1, self.total + 1)
                                          if self.total % k == 0)))
        for group in range(self.count):
            processes = self.processes(group)
            members = set(self.replicas(group))
            parts = [p for p in processes if not set(self.replicas_of(p)) <= members]
            if len(processes) > 1 and parts:
                raise CaffeError('sync_bn_group_size %d: group %d (replicas %s) would take part of '
                                 "process %d's replicas (%s) and part of another's (%s); a group "
                                 'must lie within a process or be made of whole processes: give '
                                 'a size that divides the replicas of each process or is a '
                                 'multiple of them'
                                 % (self.size, group, _span(self.replicas(group)), parts[0],
                                    _span(self.replicas_of(parts[0])), layout))

    @property
    def count(self):
        return self.total // self.size

    def replicas(self, group):
        """The global ranks of ``group``."""
        return list(range(group * self.size, (group + 1) * self.size))

    def replicas_of(self, process):
        return list(range(self.offsets[process], self.offsets[process] + self.counts[process]))

    def processes(self, group):
        """The processes that hold replicas of ``group``, in order."""
        members = set(self.replicas(group))
        return [p for p in range(len(self.counts)) if members & set(self.replicas_of(p))]

    def group_of(self, rank):
        return rank // self.size

    def describe(self, nodes=None):
        """One line per group: its replicas and where they run (``nodes``: the node of each
        process, MpiLink.nodes), and what its SyncBN sums cross."""
        lines = []
        for group in range(self.count):
            processes = self.processes(group)
            where = ('process %s' % _span(processes) if len(processes) == 1 else
                     'processes %s' % _span(processes))
            if len(self.counts) == 1:
                where = 'threads of this process' if self.size > 1 else 'no exchange'
            elif len(processes) == 1:
                where += ', no traffic between processes'
            elif nodes is not None and len({nodes[p] for p in processes}) > 1:
                where += ', across nodes %s' % ', '.join(str(n) for n in
                                                         sorted({nodes[p] for p in processes}))
            elif nodes is not None:
                where += ', within node %d' % nodes[processes[0]]
            lines.append('group %d: replicas %s (%s)' % (group, _span(self.replicas(group)),
                                                         where))
        return lines

    def crossing_nodes(self, nodes):
        """The groups whose processes run on more than one node."""
        return [g for g in range(self.count) if len({nodes[p] for p in self.processes(g)}) > 1]


def group_communicators(devices, link, groups, first, comms=()):
    """One communicator member per local device (global replicas ``first`` ...), each of
    the group its replica belongs to (see the module docstring), ordered with the member of
    ``comms`` (all replicas') on its device (Communicator.share_order_with). Every process
    calls it at the same point: the groups that span processes split the link's MPI
    communicator."""
    local = range(first, first + len(devices))
    spanning = [g for g in range(groups.count) if len(groups.processes(g)) > 1]
    sublink = None
    if link is not None and spanning:
        mine = [g for g in spanning if link.rank in groups.processes(g)]
        sublink = link.split(mine[0] if mine else None)
    members = []
    for group in sorted({groups.group_of(rank) for rank in local}):
        part = [devices[rank - first] for rank in groups.replicas(group) if rank in local]
        members += communicators(part, sublink if group in spanning else None)
    for member, full in zip(members, comms):
        member.share_order_with(full)
    return members
