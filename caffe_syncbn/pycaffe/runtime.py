"""pycaffe's process-wide helpers: logging, Timer, the solver count and rank, and NCCL.

Several devices train through one process here (``caffe_syncbn.get_solver(path,
devices='gpu:0,1')`` or ``caffe-syncbn train -gpu 0,1``), or through one such process per
machine under mpiexec, not through pycaffe's multiprocessing with one process per GPU. So
``NCCL`` only covers the one-solver case of pycaffe's train.py, and refuses more.
"""
import logging
import os
import time

from ..backend import mode
from ..errors import CaffeError
from ..glog import setup_logging

logger = logging.getLogger('caffe_syncbn')
_solvers = {'count': 1, 'rank': 0, 'multiprocess': False}

# glog's severities: INFO, WARNING, ERROR, FATAL
_GLOG_LEVELS = [logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL]


def init_log(level=0, stderr=True):
    """Log in glog's format on stderr from glog severity ``level`` (0 INFO ... 3 FATAL) up;
    with ``stderr=False`` from ERROR up (glog would write the rest to files)."""
    if not 0 <= level < len(_GLOG_LEVELS):
        raise CaffeError('init_log: level %r is not a glog severity (0 INFO to 3 FATAL)' % (level,))
    setup_logging(level=_GLOG_LEVELS[level if stderr else max(level, 2)])


def log(message):
    """One INFO line in the package's log, as pycaffe's caffe.log writes to glog."""
    logger.info('%s', message)


def solver_count():
    return _solvers['count']


def set_solver_count(count):
    _solvers['count'] = int(count)


def solver_rank():
    return _solvers['rank']


def set_solver_rank(rank):
    _solvers['rank'] = int(rank)


def set_multiprocess(multiprocess):
    _solvers['multiprocess'] = bool(multiprocess)


def has_nccl():
    """False: pycaffe's multi-process NCCL is not provided (see the module's docstring);
    data-parallel training uses NCCL through get_solver(devices='gpu:...') instead."""
    return False


class NCCL:
    """pycaffe's NCCL(solver, uid) for one solver, where there is nothing to synchronize:
    pycaffe's train.py runs unchanged on one GPU. More solvers are refused."""

    def __init__(self, solver, uid):
        if solver_count() > 1:
            raise CaffeError("caffe.NCCL with %d solvers (one process per GPU) is not supported; "
                             "train on several devices in one process with caffe_syncbn.get_solver("
                             "path, devices='gpu:0,1,...') or caffe-syncbn train -gpu 0,1,... "
                             '(under mpiexec -n N for several machines)'
                             % solver_count())
        self.solver = solver

    @staticmethod
    def new_uid():
        return os.urandom(128)

    def bcast(self):
        """Broadcast the root's weights: nothing to do for one solver."""

    def on_start(self):
        pass

    def on_gradients_ready(self):
        pass


class Timer:
    """pycaffe's Timer: ``start()``, ``stop()``, and ``ms`` since start (or between the two).
    In GPU mode the device is synchronized first, as Caffe's CUDA-event timer measures."""

    def __init__(self):
        self._start = self._stop = None

    @staticmethod
    def _now():
        if mode() == 'gpu':
            import cupy
            cupy.cuda.get_current_stream().synchronize()
        return time.perf_counter()

    def start(self):
        self._start, self._stop = self._now(), None

    def stop(self):
        if self._start is not None:
            self._stop = self._now()

    @property
    def ms(self):
        if self._start is None:
            return 0.0
        end = self._stop if self._stop is not None else self._now()
        return (end - self._start) * 1000.0
