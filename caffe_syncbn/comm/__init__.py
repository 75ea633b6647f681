"""Communicators: how the replicas of a data-parallel run exchange arrays.

``Communicator`` (base.py) is the interface; ``ThreadComm`` (thread.py) joins the
threads of one process, ``SoloComm`` (solo.py) is a run with one replica. NCCL and MPI
communicators implement the same interface.
"""
from .base import (CollectiveMismatch, CommAborted, Communicator, CompletedHandle,
                   Handle)
from .solo import SoloComm
from .thread import ThreadComm

__all__ = ['CollectiveMismatch', 'CommAborted', 'Communicator', 'CompletedHandle',
           'Handle', 'SoloComm', 'ThreadComm']
