"""NcclComm: the Communicator over NCCL, through ``cupy.cuda.nccl`` only.

    comms = NcclComm.create_all([0, 1, 2, 3])      # one process, a thread per GPU
    uid = NcclComm.unique_id()                     # several processes: share uid, then
    comm = NcclComm.from_unique_id(nranks, uid, rank)

Collectives are stream-ordered: each member enqueues its NCCL call on its own side
stream (one per member, so a member's NCCL calls run in the order they were issued,
as NCCL requires) after an event of the caller's current stream, and a blocking
collective makes the current stream wait for it. Nothing waits on the host except
``barrier`` and collectives on host (numpy) arrays. ``allreduce_async`` returns a
handle whose ``wait()`` orders the caller's current stream after the reduction; the
gradient buckets use it to overlap backward. ``group()`` fuses several calls
(ncclGroupStart/End); ``allreduce_many`` uses it for a list of buffers.

Groups made by ``create_all`` also meet on the host (rendezvous.py), so that
collectives issued in different orders raise CollectiveMismatch on every member
instead of hanging on the GPU, and ``abort`` wakes waiting members and aborts every
member's NCCL communicator (ncclCommAbort ends kernels waiting on a dead peer).
Ranks joined across processes (``join_ranks`` with a ``link``) meet on the host too: the
ranks of a process compare their calls there, and the last to arrive compares the call with
every other process's through the link (rendezvous.compare_across, one small MPI
allgather per collective, on the host: the GPU never waits for it) before NCCL runs it, so
a process that skipped a layer fails every process at once instead of hanging a kernel.
``abort`` aborts the communicators of this process's ranks, and the process launcher must
stop the others.

NCCL needs distinct GPUs: for replicas that share one, use SameDeviceComm.
"""
import contextlib

import numpy as np

from ..backend.device import RUNTIMES
from .base import CommAborted, Communicator, Handle
from .rendezvous import DEFAULT_TIMEOUT, Call, Group, ValueCall, compare_across, sum_values


def nccl_module():
    """The NCCL module of the GPU runtime (cupy.cuda.nccl)."""
    return RUNTIMES['gpu'].nccl()


def _dtype_codes(nccl):
    return {np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
            np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int32): nccl.NCCL_INT32,
            np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.uint8): nccl.NCCL_UINT8}


class _Members:
    """The raw communicators of this process's ranks, for an abort of them all."""

    def __init__(self, raw):
        self.raw = list(raw)
        self.aborted = False
        self.cause = None

    def abort_all(self, cause):
        if self.aborted:
            return
        self.aborted, self.cause = True, cause
        for comm in self.raw:
            try:
                comm.abort()
            except Exception:           # already destroyed or aborted: nothing left to stop
                pass


class NcclComm(Communicator):
    """One NCCL rank (see the module docstring)."""

    @classmethod
    def create_all(cls, device_ids, timeout=DEFAULT_TIMEOUT, nccl=None, streams_for=None):
        """Members for ``device_ids`` (distinct GPUs) driven by the threads of this process.
        ``nccl``/``streams_for(device)`` replace the GPU runtime's NCCL module and streams."""
        devices = [int(d) for d in device_ids]
        if len(set(devices)) != len(devices):
            raise ValueError('NCCL needs one rank per GPU, got devices %s; replicas sharing a '
                             'GPU need SameDeviceComm' % devices)
        nccl = nccl or nccl_module()
        raw = nccl.NcclCommunicator.initAll(devices)
        group, members = Group(len(devices), timeout), _Members(raw)
        return [cls(raw[r], r, len(devices), _streams(streams_for, d), nccl, group, members)
                for r, d in enumerate(devices)]

    @classmethod
    def from_unique_id(cls, nranks, uid, rank, device=None, nccl=None, streams_for=None):
        """Rank ``rank`` of ``nranks`` processes that share ``uid`` (from unique_id()), as
        unique_id() gave it: CuPy 14 takes the bytes its get_unique_id returns, and refuses
        anything else."""
        nccl = nccl or nccl_module()
        streams = _streams(streams_for, device)
        with streams.device_scope():
            raw = nccl.NcclCommunicator(int(nranks), uid, int(rank))
        return cls(raw, int(rank), int(nranks), streams, nccl, None, _Members([raw]))

    @classmethod
    def join_ranks(cls, nranks, uid, first_rank, device_ids, nccl=None, streams_for=None,
                   link=None, timeout=DEFAULT_TIMEOUT):
        """This process's ranks ``first_rank``, ``first_rank + 1``, ... of ``nranks`` that
        share ``uid``, one per GPU of ``device_ids``, joined in one NCCL group (one thread
        initializes them all); an abort of one aborts them all. With ``link`` (the other
        processes: ``allgather_bytes``), every collective is compared across processes
        first (see the module docstring)."""
        nccl = nccl or nccl_module()
        members = []
        nccl.groupStart()
        try:
            for k, device in enumerate(device_ids):
                members.append(cls.from_unique_id(nranks, uid, first_rank + k, device=device,
                                                  nccl=nccl, streams_for=streams_for))
        finally:
            nccl.groupEnd()
        local = _Members([member._raw for member in members])
        group = Group(len(members), timeout) if link is not None else None
        for index, member in enumerate(members):
            member._members, member._group, member._index = local, group, index
            member._link = link
        return members

    @staticmethod
    def unique_id(nccl=None):
        return (nccl or nccl_module()).get_unique_id()

    def __init__(self, raw, rank, size, streams, nccl, group, members):
        self._raw, self._nccl, self._streams = raw, nccl, streams
        self._group, self._members = group, members
        #: this rank's place in ``_group``, and the other processes' link (None: one process)
        self._index, self._link = rank, None
        self.rank, self.size = rank, size
        self._codes = _dtype_codes(nccl)
        self._side = None

    # ---- collectives -------------------------------------------------------------------
    def allreduce(self, array, tag=None):
        if not self._streams.is_device_array(array):
            return self._via_device(array, lambda d: self.allreduce(d, tag))
        self._wait_on(self._enqueue('allreduce', tag, [array]))
        return array

    def allreduce_async(self, array, tag=None):
        if not self._streams.is_device_array(array):
            raise TypeError('allreduce_async takes device arrays, got %s' % type(array).__name__)
        return _NcclHandle(self._streams, array, self._enqueue('allreduce', tag, [array]))

    def allreduce_many(self, arrays, tag=None):
        """Allreduce several device buffers in one NCCL group call."""
        self._wait_on(self._enqueue('allreduce', tag, list(arrays)))
        return arrays

    def broadcast(self, array, root=0, tag=None):
        if not 0 <= root < self.size:
            raise ValueError('broadcast root %d out of range for %d members' % (root, self.size))
        if not self._streams.is_device_array(array):
            return self._via_device(array, lambda d: self.broadcast(d, root, tag))
        self._wait_on(self._enqueue('broadcast', tag, [array], root))
        return array

    def allreduce_scalar(self, value, tag=None):
        if self._in_one_process():       # threads of one process: a host sum, no GPU sync
            return self._meet(ValueCall('allreduce_scalar', tag, float(value)), sum_values)
        return super().allreduce_scalar(value, tag=tag)

    def barrier(self, tag=None):
        if self._in_one_process():
            self._meet(Call('barrier', tag))
            return
        token = self._streams.to_device(np.zeros(1, np.float32))
        done = self._enqueue('allreduce', tag, [token])
        self._streams.wait_host(done)

    def abort(self, exc):
        if self._group is not None:
            self._group.fail(CommAborted, 'collectives aborted because a replica failed: %r'
                             % (exc,), exc)
        self._members.abort_all(exc)

    def share_order_with(self, other):
        """One side stream with ``other`` (an NcclComm on the same GPU): every replica issues
        the collectives of both in the same order, so the kernels of the two communicators
        run in that order on every GPU, and none waits for a peer stuck behind the other."""
        if isinstance(other, NcclComm):
            self._side = other.side_stream()

    def side_stream(self):
        """The stream this member's NCCL calls run on (made on first use)."""
        if self._side is None:
            self._side = self._streams.new_stream()
        return self._side

    @contextlib.contextmanager
    def group(self):
        """NCCL group: the collectives issued inside are launched together at the end."""
        self._nccl.groupStart()
        try:
            yield self
        finally:
            self._nccl.groupEnd()

    # ---- implementation ----------------------------------------------------------------
    def _enqueue(self, op, tag, arrays, root=None):
        """Check the call against the other members, enqueue it on the side stream after
        the current stream's work, and return the event that marks it done."""
        for a in arrays:
            if not a.flags.c_contiguous:
                raise ValueError('NCCL reduces contiguous arrays, got shape %s strides %s'
                                 % (a.shape, a.strides))
            if a.dtype not in self._codes:
                raise TypeError('NCCL has no %s type' % a.dtype)
        if self._group is not None:      # compare the calls on the host first
            call = Call(op, tag, arrays[0] if len(arrays) == 1 else _Signature(arrays), root)
            self._meet(call, None if self._link is None
                       else lambda calls: compare_across(self._link, calls[0]))
        if self._members.aborted:
            raise self._aborted(op, tag)
        streams, side = self._streams, self.side_stream()
        current = streams.current_stream()
        streams.wait_event(side, streams.record_event(current))
        handle = streams.handle(side)
        try:
            with streams.device_scope(), self.group() if len(arrays) > 1 else _nothing():
                for a in arrays:
                    ptr, code = streams.pointer(a), self._codes[a.dtype]
                    if op == 'allreduce':
                        self._raw.allReduce(ptr, ptr, a.size, code, self._nccl.NCCL_SUM, handle)
                    else:
                        self._raw.broadcast(ptr, ptr, a.size, code, root, handle)
        except Exception as exc:
            if self._members.aborted:
                raise self._aborted(op, tag) from exc
            raise
        return streams.record_event(side)

    def _in_one_process(self):
        return self._group is not None and self._link is None

    def _meet(self, call, complete=None):
        call.iteration = self.iteration
        return self._group.rendezvous(self._index, call, complete)

    def _aborted(self, op, tag):
        return CommAborted('NCCL communicator of rank %d was aborted because a replica failed: '
                           '%r [in %s %r]' % (self.rank, self._members.cause, op, tag))

    def _wait_on(self, done):
        self._streams.wait_event(self._streams.current_stream(), done)

    def _via_device(self, array, collective):
        device = self._streams.to_device(np.ascontiguousarray(array))
        collective(device)
        self._streams.to_host(device, array)
        return array


class _NcclHandle(Handle):
    def __init__(self, streams, array, done):
        self._streams, self._array, self._done = streams, array, done

    def done(self):
        return self._streams.event_done(self._done)

    def wait(self, timeout=None):
        """Orders the caller's current stream after the reduction (no host wait)."""
        self._streams.wait_event(self._streams.current_stream(), self._done)
        return self._array


class _Signature:
    """Shape/dtype stand-in of a list of buffers, for the host comparison of calls."""

    class _Dtypes:
        def __init__(self, arrays):
            self.str = ','.join(a.dtype.str for a in arrays)
            self.name = ','.join(a.dtype.name for a in arrays)

    def __init__(self, arrays):
        self.shape = tuple(a.shape for a in arrays)
        self.dtype = self._Dtypes(arrays)


def _streams(streams_for, device):
    runtime = RUNTIMES['gpu']
    if device is None:
        device = runtime.current_index()
    return (streams_for or runtime.streams)(device)


@contextlib.contextmanager
def _nothing():
    yield
