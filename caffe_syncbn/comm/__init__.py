"""Communicators: how the replicas of a data-parallel run exchange arrays.

``Communicator`` (base.py) is the interface. ``GroupMember`` (rendezvous.py) is the base
of the members of an in-process group, which meet to compare and complete each
collective: ``ThreadComm`` (thread.py) joins the threads of one process,
``SameDeviceComm`` (same_device.py) replicas sharing a GPU, ``ProcessGroupComm`` (mpi.py)
threads across processes; ``NcclComm`` (nccl.py) meets there before NCCL runs. ``SoloComm``
(solo.py) is a run with one replica. ``communicators(devices)`` (for_devices.py) picks the
kind for a list of devices.
"""
from .base import (CollectiveMismatch, CommAborted, Communicator, CompletedHandle,
                   Handle)
from .for_devices import communicators
from .solo import SoloComm
from .thread import ThreadComm

__all__ = ['CollectiveMismatch', 'CommAborted', 'Communicator', 'CompletedHandle',
           'Handle', 'SoloComm', 'ThreadComm', 'communicators']
