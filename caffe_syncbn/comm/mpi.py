"""Communicators across processes, over MPI (mpi4py and the MPI library it runs on).

    link = job_link()                        # this process of the job mpiexec/srun started
    comms = ProcessGroupComm.create(link, 4) # CPU: 4 replicas here, all replicas of all processes
    comms = nccl_across_processes(link, [0, 1, 2, 3])   # GPU: one NCCL communicator over all

Replica k of process p is global rank ``offset_p + k``, where ``offset_p`` counts the
replicas of the processes before it; ``size`` is the replicas of all processes.

**Determinism.** ``ProcessGroupComm`` sums in global rank order, exactly as ThreadComm sums
in rank order: every element is ((a0 + a1) + a2) + ... So P processes of R replicas give
bitwise the result of one process of P x R replicas, however the ranks are placed. MPI's
reductions may regroup a sum, so they are not used for it: the processes pass a partial
sum along in rank order (process p waits for the sum of the ranks before it, adds its own
replicas' arrays in order and passes it on), and the last one broadcasts the total.

**Mismatches.** Before each collective the processes exchange a record of the call (op,
tag, shape, dtype, iteration; rendezvous.compare_across): a process that skipped a layer,
ran another or is an iteration apart fails every process at once, with one line naming
what each called. It costs one small non-blocking allgather per collective.

**Faults.** An MPI call blocks for ever when a peer dies, so nothing here blocks in MPI
once the link is up (counting the processes on each node when it starts, and splitting off
the communicators of groups that span processes, are blocking collectives): every wait
polls a non-blocking request and gives up when the local group failed, when the link
failed, or at a deadline. A watchdog thread exchanges heartbeats with every other
process; a process silent for ``peer_timeout`` seconds (killed, out of memory, stopped)
fails the link with a message naming it, every wait raises ``CommAborted``, and the job
ends through ``abort_job`` (MPI_Abort), which the error path of the command calls after
printing the original error. If the process has not ended ``grace`` seconds after such a
failure, the watchdog ends it.
"""
import atexit
import contextlib
import functools
import os
import sys
import threading
import time

import numpy as np

from ..errors import CaffeError
from .base import CommAborted
from .nccl import NcclComm, nccl_module
from .rendezvous import DEFAULT_TIMEOUT, Call, Group, GroupMember, compare_across

#: how often a process tells the others it is alive, and how long a silence may last
HEARTBEAT_SECONDS = 1.0
PEER_TIMEOUT = float(os.environ.get('CAFFE_SYNCBN_PEER_TIMEOUT', 20))
#: the longest wait in one collective: process 0 may be testing or snapshotting meanwhile
COLLECTIVE_TIMEOUT = float(os.environ.get('CAFFE_SYNCBN_COLLECTIVE_TIMEOUT', 1800))
GRACE_SECONDS = 10.0
#: how long a wait polls without sleeping before it lets the core go between polls (when
#: the processes on a machine are no more than its cores)
SPIN_SECONDS = 0.002
_CHAIN, _HEARTBEAT = 11, 12
#: the launchers' variables that give the number of processes of a job
_SIZE_VARIABLES = ('PMI_SIZE', 'OMPI_COMM_WORLD_SIZE', 'MV2_COMM_WORLD_SIZE',
                   'SLURM_STEP_NUM_TASKS', 'PMIX_SIZE')

_link = None


def launched_processes():
    """How many processes the launcher (mpiexec, mpirun, srun) started, from its
    environment: 1 outside a launcher. MPI itself is not started to find out."""
    for name in _SIZE_VARIABLES:
        value = os.environ.get(name, '')
        if value.isdigit() and int(value) > 1:
            return int(value)
    return 1


def job_link():
    """This process's MpiLink in a job of several processes, or None (one process).

    For a Python script that trains under mpiexec: an uncaught exception prints its
    traceback and ends the job (MPI_Abort), and a normal exit waits for the other
    processes first, so that none takes a finished process for a dead one."""
    global _link
    if _link is None and launched_processes() > 1:
        try:
            from mpi4py import MPI  # noqa: F401
        except ImportError:
            raise CaffeError('this process was started by an MPI launcher (%d processes), but '
                             "mpi4py is not installed: pip install 'caffe-syncbn[mpi]'"
                             % launched_processes()) from None
        _link = MpiLink()
        if _link.size == 1:
            _link.close()
            _link = False
        else:
            atexit.register(_link.close)
            sys.excepthook = functools.partial(_abort_after, sys.excepthook, _link)
    return _link or None


def _abort_after(report, link, kind, value, traceback):
    report(kind, value, traceback)
    link.abort_job(1)


class Channel:
    """MPI point-to-point and collectives over one MPI communicator (``comm``) that never
    block for ever: every wait polls through ``wait`` (MpiLink's: see the module
    docstring). ``rank`` and ``size`` are this process's place in ``comm``."""

    def send(self, array, dest, what):
        self.wait(self.comm.Isend(array, dest=dest, tag=_CHAIN), what)

    def recv(self, array, source, what):
        self.wait(self.comm.Irecv(array, source=source, tag=_CHAIN), what)

    def bcast(self, array, root, what):
        self.wait(self.comm.Ibcast(array, root=root), what)

    def barrier(self, what='barrier'):
        self.wait(self.comm.Ibarrier(), what)

    def send_object(self, value, dest, tag, what):
        """Send a picklable ``value`` (arrays and all) to process ``dest``."""
        self.wait(self.comm.isend(value, dest=dest, tag=tag), what)

    def recv_object(self, source, tag, what):
        """The next value process ``source`` sent with ``tag``."""
        self.poll(lambda: self.comm.Iprobe(source=source, tag=tag), what)
        return self.comm.recv(source=source, tag=tag)

    def allgather(self, value):
        """Every process's ``value`` (an int), in rank order."""
        values = np.zeros(self.size, np.int64)
        self.wait(self.comm.Iallgather(np.array([value], np.int64), values), 'allgather')
        return [int(v) for v in values]

    def allgather_bytes(self, payload):
        """Every process's ``payload`` (bytes, of one length in every process), in rank
        order: rendezvous.compare_across's exchange of the calls' records."""
        size = len(payload)
        gathered = np.empty(self.size * size, np.uint8)
        self.wait(self.comm.Iallgather(np.frombuffer(payload, np.uint8), gathered),
                  'the comparison of the collectives')
        return [gathered[p * size:(p + 1) * size].tobytes() for p in range(self.size)]

    def bcast_bytes(self, payload, root=0):
        """``payload`` (bytes) of process ``root``, on every process."""
        length = np.array([len(payload) if self.rank == root else 0], np.int64)
        self.bcast(length, root, 'broadcast of a length')
        buffer = np.frombuffer(payload, np.uint8).copy() if self.rank == root \
            else np.empty(int(length[0]), np.uint8)
        self.bcast(buffer, root, 'broadcast of bytes')
        return buffer.tobytes()


class MpiLink(Channel):
    """This process in the job: MPI point-to-point and collectives that never block for
    ever (see the module docstring), the heartbeat watchdog and the end of the job."""

    def __init__(self, timeout=COLLECTIVE_TIMEOUT, peer_timeout=PEER_TIMEOUT):
        from mpi4py import MPI
        self.MPI = MPI
        world = MPI.COMM_WORLD
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise CaffeError("the MPI library gives no MPI_THREAD_MULTIPLE, which the replicas' "
                             'threads need: use an MPI built with thread support (pip install '
                             "'caffe-syncbn[mpi]' brings one)")
        self.comm, self._heartbeats = world.Dup(), world.Dup()
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.timeout, self.peer_timeout = float(timeout), float(peer_timeout)
        self.failure = None
        # polling without sleeping helps only where every process has a core to itself
        self.spin = SPIN_SECONDS if self.processes_on_this_node() <= (os.cpu_count() or 1) else 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name='mpi-watchdog', daemon=True)
        self._watchdog.start()

    # ---- waiting without hanging -----------------------------------------------------------
    def wait(self, request, what):
        """Poll ``request`` until it completes; raise CommAborted when the link fails or
        after ``timeout`` seconds."""
        self.poll(request.Test, what)

    def poll(self, done, what):
        """Return once ``done()`` holds; raise as ``wait`` does."""
        start = time.monotonic()
        spin_until, deadline = start + self.spin, start + self.timeout
        pause = 0.0
        while not done():
            now = time.monotonic()
            if now < spin_until:         # most waits are short: keep the core meanwhile
                continue
            if self.failure is not None:
                raise CommAborted('%s [process %d, in %s]' % (self.failure, self.rank, what))
            if now > deadline:
                self.fail('process %d waited %g s in %s; a peer stopped taking part'
                          % (self.rank, self.timeout, what))
                raise CommAborted(self.failure)
            time.sleep(pause)
            pause = min(0.0005, pause + 0.00005)

    # ---- where the processes are -----------------------------------------------------------
    def processes_on_this_node(self):
        """How many processes of the job share this machine (MPI_COMM_TYPE_SHARED)."""
        node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        try:
            return node.Get_size()
        finally:
            node.Free()

    def nodes(self):
        """The node (machine) of each process, numbered 0, 1, ... in the order of their first
        process; a collective of every process (blocking, as the link's start)."""
        node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        try:
            first = node.bcast(self.rank, root=0)
        finally:
            node.Free()
        firsts = self.allgather(first)
        order = sorted(set(firsts))
        return [order.index(f) for f in firsts]

    def split(self, color):
        """A SubLink over the processes that give the same ``color`` (None: this process
        joins none, and gets None); a collective of every process (blocking, as MPI's
        Comm_split), so every process calls it at the same point."""
        comm = self.comm.Split(self.MPI.UNDEFINED if color is None else int(color), self.rank)
        return None if comm == self.MPI.COMM_NULL else SubLink(self, comm)

    # ---- failure -------------------------------------------------------------------------------
    def fail(self, message):
        """Fail the link: every wait raises; the watchdog ends the process after a grace."""
        with self._lock:
            if self.failure is None:
                self.failure = message
                self._failed_at = time.monotonic()

    def abort_job(self, code=1):
        """MPI_Abort: the launcher ends every process of the job."""
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)

    # ---- the watchdog --------------------------------------------------------------------------
    def _watch(self):
        MPI, comm = self.MPI, self._heartbeats
        peers = [p for p in range(self.size) if p != self.rank]
        token, inbox = np.zeros(1, np.uint8), {p: np.zeros(1, np.uint8) for p in peers}
        receiving = {p: comm.Irecv(inbox[p], source=p, tag=_HEARTBEAT) for p in peers}
        sending = {p: None for p in peers}
        heard = {p: time.monotonic() for p in peers}
        next_beat = 0.0
        while not self._stop.wait(0.05):
            now = time.monotonic()
            try:
                for p in peers:
                    while receiving[p].Test():
                        heard[p] = now
                        receiving[p] = comm.Irecv(inbox[p], source=p, tag=_HEARTBEAT)
                    if now >= next_beat and (sending[p] is None or sending[p].Test()):
                        sending[p] = comm.Isend(token, dest=p, tag=_HEARTBEAT)
            except MPI.Exception as exc:
                self.fail('MPI failed while exchanging heartbeats: %s' % exc)
            if now >= next_beat:
                next_beat = now + HEARTBEAT_SECONDS
            silent = [p for p in peers if now - heard[p] > self.peer_timeout]
            if silent and self.failure is None:
                self.fail('process(es) %s sent no heartbeat for %g s: killed, out of memory or '
                          'stopped; ending the job' % (', '.join(map(str, silent)),
                                                       self.peer_timeout))
            if self.failure is not None and now - self._failed_at > GRACE_SECONDS:
                sys.stderr.write('[rank %d] error: %s\n' % (self.rank, self.failure))
                self.abort_job(1)
        for request in list(receiving.values()):
            request.Cancel()
            request.Wait()

    def close(self):
        """The end of a run: wait for every process (so that none takes a finished peer
        for a dead one), then stop the watchdog."""
        if self._stop.is_set():
            return
        if self.size > 1 and self.failure is None:
            self.barrier('the closing barrier')
        self._stop.set()
        self._watchdog.join(5.0)


class SubLink(Channel):
    """Some processes of the job (MpiLink.split), over an MPI communicator of their own:
    what a communicator of a group of replicas that spans processes needs (a SyncBN group,
    comm/groups.py). Its waits are its link's: they give up when the link fails."""

    def __init__(self, link, comm):
        self.link, self.comm = link, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def wait(self, request, what):
        self.link.wait(request, what)

    def poll(self, done, what):
        self.link.poll(done, what)


@contextlib.contextmanager
def ending_job_on_error(link, report):
    """Run the body; if it raises in a job of several processes, ``report(exc)`` (the
    original error, as the command prints it) and MPI_Abort, so no peer waits for ever."""
    try:
        yield
    except BaseException as exc:
        if link is None:
            raise
        report(exc)
        link.abort_job(1)


class _Processes:
    """What the replicas of one process share: the link and where they sit globally."""

    def __init__(self, link, counts):
        self.link, self.counts = link, counts
        self.offset, self.total = sum(counts[:link.rank]), sum(counts)

    def owner(self, rank):
        """(process, local index) of global ``rank``."""
        left = rank
        for process, count in enumerate(self.counts):
            if left < count:
                return process, left
            left -= count
        raise ValueError('rank %d out of range: the job has %d replicas' % (rank, self.total))


class ProcessGroupComm(GroupMember):
    """One replica of a group that spans processes: the threads inside a process meet
    (rendezvous.py), and the last to arrive does the MPI part for all of them, after
    comparing the call with every other process's (rendezvous.compare_across). Its place in
    the process's group is ``index``; its ``rank`` is global. ``link`` is the MpiLink, or a
    SubLink of some processes (a SyncBN group)."""

    @classmethod
    def create(cls, link, local_size, timeout=DEFAULT_TIMEOUT):
        processes = _Processes(link, link.allgather(local_size))
        group = Group(local_size, timeout)
        return [cls(group, k, processes) for k in range(local_size)]

    def __init__(self, group, index, processes):
        super().__init__(group, index)
        self._processes = processes
        self.rank, self.size = processes.offset + index, processes.total

    def allreduce(self, array, tag=None):
        return self.in_order(self._allreduce, _host(array), tag)

    def allreduce_async(self, array, tag=None):
        return self.in_order_async(self._allreduce, _host(array), tag)

    def broadcast(self, array, root=0, tag=None):
        if not 0 <= root < self.size:
            raise ValueError('broadcast root %d out of range for %d members' % (root, self.size))
        return self.in_order(self._broadcast, _host(array), root, tag)

    def barrier(self, tag=None):
        link = self._processes.link

        def across(calls):
            compare_across(link, calls[0])
            link.barrier('barrier %r' % (tag,))
        self.in_order(self.meet, Call('barrier', tag), across)

    # ---- implementation ----------------------------------------------------------------
    def _allreduce(self, array, tag):
        total = self.meet(Call('allreduce', tag, array), lambda calls: self._chain_sum(calls, tag))
        array[...] = total
        return array

    def _chain_sum(self, calls, tag):
        link, what = self._processes.link, 'allreduce %r' % (tag,)
        compare_across(link, calls[0])
        process, last = link.rank, link.size - 1
        if process == 0:
            total = calls[0].array.copy()
            calls = calls[1:]
        else:
            total = np.empty_like(calls[0].array)
            link.recv(total, process - 1, what)
        for call in calls:
            total += call.array
        if process < last:
            link.send(total, process + 1, what)
        link.bcast(total, last, what)
        return total

    def _broadcast(self, array, root, tag):
        owner, local = self._processes.owner(root)

        def across(calls):
            link = self._processes.link
            compare_across(link, calls[0])
            value = calls[local].array.copy() if link.rank == owner else np.empty_like(array)
            link.bcast(value, owner, 'broadcast %r' % (tag,))
            return value

        array[...] = self.meet(Call('broadcast', tag, array, root), across)
        return array


def _host(array):
    if not isinstance(array, np.ndarray):
        raise TypeError('ProcessGroupComm works on numpy arrays, got %s' % type(array).__name__)
    if not array.flags.c_contiguous:
        raise ValueError('MPI sends contiguous arrays, got strides %s' % (array.strides,))
    return array


def nccl_across_processes(link, device_ids, nccl=None, streams_for=None):
    """One NCCL communicator over every GPU of every process, as Caffe's multi-node forks
    built it: process 0 makes the unique id, MPI broadcasts it, and each process joins with
    its GPUs at their global ranks (ncclCommInitRank, grouped: one thread inits them all).
    Each collective is compared with the other processes' over ``link`` before NCCL runs
    it (NcclComm.join_ranks)."""
    nccl = nccl or nccl_module()
    processes = _Processes(link, link.allgather(len(device_ids)))
    uid = link.bcast_bytes(NcclComm.unique_id(nccl) if link.rank == 0 else b'')
    return NcclComm.join_ranks(processes.total, uid, processes.offset, device_ids, nccl=nccl,
                               streams_for=streams_for, link=link)
