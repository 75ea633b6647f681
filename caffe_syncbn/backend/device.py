"""Devices: where a replica's arrays live and its work runs.

A ``Device`` is a kind and an index, ``Device('gpu', 1)``, written ``gpu:1``. What a kind
can do is its runtime, found by kind name in ``RUNTIMES``: ``HostRuntime`` for 'cpu'
(numpy arrays; work is done when it is called) and ``CudaRuntime`` (cuda_runtime.py) for
'gpu'. The tests put a CPU emulation of the CUDA runtime under 'gpu' to run the GPU path
without a GPU (tests/helpers/emulated_gpu.py), so nothing above this floor asks which it has.

A runtime answers:

- ``array_module()``: numpy, cupy, or the emulation's module;
- ``owns(array)``: whether ``array`` is one of its device arrays; ``to_host(array)``;
- ``count()`` and ``name(index)``: the devices it sees;
- ``activate(index)``: in a replica's worker thread, make the device current with a
  stream of the thread's own; ``select(index)``: the device current for the caller
  (pycaffe's ``set_device``), on the stream it had;
- ``synchronize(index)``: block the calling thread until the work it queued on the
  device is done. Work queued by one thread is not ordered with another thread's stream,
  so whoever hands arrays to another thread synchronizes first (``DevicePool`` does, on
  both sides of every call);
- ``streams(index)`` and ``nccl()``: what the device communicators use.
"""
import collections

import numpy as np

from .cuda_runtime import CudaRuntime


class HostRuntime:
    """The CPU: numpy arrays, nothing queued, so nothing to wait for."""

    def array_module(self):
        return np

    def owns(self, array):
        return False

    def to_host(self, array):
        return np.asarray(array)

    def activate(self, index):
        pass

    def select(self, index):
        pass

    def synchronize(self, index):
        pass


RUNTIMES = {'cpu': HostRuntime(), 'gpu': CudaRuntime()}


class Device(collections.namedtuple('Device', 'kind index')):
    """One device of a run (see the module docstring)."""

    __slots__ = ()

    @property
    def runtime(self):
        return RUNTIMES[self.kind]

    @property
    def xp(self):
        return self.runtime.array_module()

    def activate(self):
        self.runtime.activate(self.index)

    def synchronize(self):
        self.runtime.synchronize(self.index)

    def __str__(self):
        return '%s:%d' % (self.kind, self.index)


def runtime_of(array):
    """The runtime whose device array ``array`` is (the host's for anything else)."""
    for runtime in RUNTIMES.values():
        if runtime.owns(array):
            return runtime
    return RUNTIMES['cpu']
