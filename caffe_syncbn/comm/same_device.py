"""SameDeviceComm: several replicas on ONE GPU (NCCL refuses two ranks on one device).

    comms = SameDeviceComm.create(4, device=0)   # comms[r] for the thread of replica r

Each replica works on its own stream. An allreduce of a device buffer:

1. the member records an event on its stream once its buffer is written (stream order);
2. a meeting of the members (rendezvous.py, as ThreadComm's: mismatched collectives and
   aborts raise on every member, a missing member times out) exchanges buffers and events;
3. the last member to arrive makes member 0's stream wait on every member's event (and
   on every member's last copy-out, so that the scratch is free), and enqueues there the
   sum of the R buffers, in rank order (((b0 + b1) + b2) + ...), into the group's scratch
   buffer (cuda/comm_sum.cu), then records a "done" event;
4. every member's stream waits on "done", copies the scratch into its buffer and records
   a "copied" event.

So the host never waits on the GPU, every member gets bitwise the same sum, and the
GPU never waits on a host (an aborted collective leaves no kernel spinning).

The stream operations go through a small backend: the GPU runtime's ``CupyStreams``
(backend/cuda_runtime.py), and the tests' HostStreams, a CPU stand-in over numpy arrays
that can defer every stream operation and run them later in a random interleaving that
honours stream order and event waits, so CI tests the ordering logic without a GPU. Host (numpy) arrays and
``allreduce_scalar`` are summed on the host in rank order, as ThreadComm does.
"""
import numpy as np

from ..backend.device import RUNTIMES
from .rendezvous import DEFAULT_TIMEOUT, Call, Group, GroupMember, ValueCall, sum_values


class _StreamCall(Call):
    """A member's call, with its stream and the event that marks its buffer ready."""
    __slots__ = ('stream', 'event')

    def __init__(self, op, tag, array=None, root=None, stream=None, event=None):
        super().__init__(op, tag, array, root)
        self.stream, self.event = stream, event


# ---- the communicator --------------------------------------------------------------------------
class _Shared:
    """What the members of one group share besides the rendezvous: backend and scratch."""

    def __init__(self, streams, size):
        self.streams = streams
        self.scratch = {}             # dtype -> flat buffer, grown as needed
        # per member: the event after its last copy-out of the scratch; the next sum
        # waits on them all (an async allreduce records its entry event before the
        # previous one's copy-out is even enqueued)
        self.copied = [None] * size

    def scratch_for(self, size, dtype, stream):
        buffer = self.scratch.get(np.dtype(dtype))
        if buffer is None or buffer.size < size:
            buffer = self.streams.empty(max(size, 1), dtype, stream)
            self.scratch[np.dtype(dtype)] = buffer
        return buffer[:size]


class SameDeviceComm(GroupMember):
    """One member of a group of replicas sharing one device (see the module docstring)."""

    @classmethod
    def create(cls, size, device=0, timeout=DEFAULT_TIMEOUT, streams=None):
        """``size`` members on ``device``; ``streams`` defaults to the GPU runtime's."""
        group = Group(size, timeout)
        shared = _Shared(streams if streams is not None else RUNTIMES['gpu'].streams(device),
                         int(size))
        return [cls(group, shared, rank) for rank in range(size)]

    def __init__(self, group, shared, rank):
        super().__init__(group, rank)
        self._shared = shared
        self._streams = shared.streams

    # ---- collectives -------------------------------------------------------------------
    def allreduce(self, array, tag=None):
        if not self._streams.is_device_array(array):
            return self.in_order(self.allreduce_host, array, tag)
        stream = self._streams.current_stream()
        event = self._streams.record_event(stream)
        return self.in_order(self._allreduce_device, array, tag, stream, event)

    def allreduce_async(self, array, tag=None):
        if not self._streams.is_device_array(array):
            return self.in_order_async(self.allreduce_host, array, tag)
        # the entry event is recorded now, so the sum sees the buffer as of this call
        stream = self._streams.current_stream()
        event = self._streams.record_event(stream)
        return self.in_order_async(self._allreduce_device, array, tag, stream, event)

    def allreduce_scalar(self, value, tag=None):
        """A host sum in rank order: no device buffer, no stream."""
        return self.in_order(self.meet, ValueCall('allreduce_scalar', tag, float(value)),
                             sum_values)

    def broadcast(self, array, root=0, tag=None):
        if not 0 <= root < self.size:
            raise ValueError('broadcast root %d out of range for %d members' % (root, self.size))
        if not self._streams.is_device_array(array):
            return self.in_order(self.broadcast_host, array, root, tag)
        stream = self._streams.current_stream()
        event = self._streams.record_event(stream)
        return self.in_order(self._broadcast, array, root, tag, stream, event)

    # ---- implementation ----------------------------------------------------------------
    def _allreduce_device(self, array, tag, stream, event):
        _require_contiguous(array)
        shared, streams = self._shared, self._streams

        def reduce_on_member0(calls):
            first = calls[0].stream
            for event in [c.event for c in calls] + shared.copied:
                if event is not None:
                    streams.wait_event(first, event)
            out = shared.scratch_for(array.size, array.dtype, first)
            streams.sum_into(out, [c.array for c in calls], first)
            return out, streams.record_event(first)

        call = _StreamCall('allreduce', tag, array, stream=stream, event=event)
        out, done = self.meet(call, reduce_on_member0)
        streams.wait_event(stream, done)
        streams.copy(array, out, stream)
        shared.copied[self.rank] = streams.record_event(stream)
        return array

    def _broadcast(self, array, root, tag, stream, event):
        _require_contiguous(array)
        streams = self._streams
        calls = self.meet(_StreamCall('broadcast', tag, array, root, stream, event))
        copied = None
        if self.rank != root:
            streams.wait_event(stream, calls[root].event)
            streams.copy(array, calls[root].array, stream)
            copied = streams.record_event(stream)
        # the root's buffer must not change before every member has copied it
        calls = self.meet(_StreamCall('broadcast (copied)', tag, event=copied))
        if self.rank == root:
            for call in calls:
                if call.event is not None:
                    streams.wait_event(stream, call.event)
        return array


def _require_contiguous(array):
    if not array.flags.c_contiguous:
        raise ValueError('SameDeviceComm works on contiguous arrays, got shape %s strides %s'
                         % (array.shape, array.strides))
