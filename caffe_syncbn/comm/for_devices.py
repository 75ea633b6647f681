"""The communicator of a list of devices: one member per local replica.

One device alone needs none to speak of (SoloComm). Otherwise: threads on the CPU
(ThreadComm), NCCL across distinct GPUs, the same-GPU communicator when one GPU repeats
(NCCL refuses two ranks on one GPU). With a ``link`` to other processes (mpi.py): a
hierarchy on the CPU (threads here, MPI across), one NCCL communicator on GPUs. The GPU
communicators take their streams and NCCL from the devices' runtime (backend/device.py).
"""
from ..backend import Device
from ..errors import CaffeError
from . import mpi
from .nccl import NcclComm
from .same_device import SameDeviceComm
from .solo import SoloComm
from .thread import ThreadComm


def communicators(devices, link=None):
    """One communicator member per device of ``devices`` (Device values or (kind, index)
    pairs), in their order (see the module docstring)."""
    devices = [Device(*d) for d in devices]
    kinds = {d.kind for d in devices}
    if len(kinds) > 1:
        raise CaffeError('devices mix CPU and GPU: %s' % ', '.join(map(str, devices)))
    ids = [d.index for d in devices]
    runtime = devices[0].runtime
    if link is not None:
        if kinds == {'cpu'}:
            return mpi.ProcessGroupComm.create(link, len(devices))
        if len(set(ids)) != len(ids):
            raise CaffeError('devices %s repeat a GPU; across processes every replica needs '
                             'a GPU of its own (one NCCL rank per GPU)'
                             % ', '.join(map(str, devices)))
        return mpi.nccl_across_processes(link, ids, nccl=runtime.nccl(),
                                         streams_for=runtime.streams)
    if len(devices) == 1:
        return SoloComm.create()
    if kinds == {'cpu'}:
        return ThreadComm.create(len(devices))
    if len(set(ids)) == 1:
        return SameDeviceComm.create(len(ids), ids[0], streams=runtime.streams(ids[0]))
    if len(set(ids)) != len(ids):
        raise CaffeError('devices %s repeat some GPUs but not all; use distinct GPUs or one GPU '
                         'repeated' % ', '.join(map(str, devices)))
    return NcclComm.create_all(ids, nccl=runtime.nccl(), streams_for=runtime.streams)
