"""Communicators: how the replicas of a data-parallel run exchange arrays.

``Communicator`` (base.py) is the interface; ``ThreadComm`` (thread.py) joins the
threads of one process, ``SoloComm`` (solo.py) is a run with one replica. NCCL and MPI
communicators implement the same interface. ``communicators(devices)`` (for_devices.py)
picks the kind for a list of devices.
"""
from .base import (CollectiveMismatch, CommAborted, Communicator, CompletedHandle,
                   Handle)
from .for_devices import communicators
from .solo import SoloComm
from .thread import ThreadComm

__all__ = ['CollectiveMismatch', 'CommAborted', 'Communicator', 'CompletedHandle',
           'Handle', 'SoloComm', 'ThreadComm', 'communicators']
