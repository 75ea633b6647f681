"""Data parallelism: one worker thread per device, each holding a replica Net.

The pool runs a function on every replica at once. If one replica raises, the pool
aborts the communicator, so replicas blocked in a collective raise promptly, and the
caller gets the ORIGINAL exception with its traceback.
"""
import concurrent.futures as futures
import os

from ..backend import gpu_count
from ..comm.base import CommAborted
from ..errors import CaffeError

ABORT_GRACE_SECONDS = 5.0


def parse_devices(devices):
    """'cpu:4', 'cpu:0,1', ['cpu:0', 'cpu:1'], 'gpu:0,1', 'gpu:all', 'gpu:0,0' -> [(kind, index)]."""
    if isinstance(devices, str):
        kind, _, rest = devices.partition(':')
        kind = kind.strip().lower()
        if kind not in ('cpu', 'gpu'):
            raise CaffeError("devices %r: expected 'cpu:N', 'cpu:i,j', 'gpu:i,j' or 'gpu:all'" % devices)
        if kind == 'cpu':
            if rest.isdigit() and ',' not in rest:
                return [('cpu', i) for i in range(int(rest))] if int(rest) > 0 else _bad(devices)
            return [('cpu', _index(i, devices)) for i in rest.split(',')] if rest else [('cpu', 0)]
        count = gpu_count()
        if count == 0:
            raise CaffeError('devices %r: no GPU is available here (CuPy missing or no CUDA '
                             'device); use CPU devices instead, e.g. cpu:4' % devices)
        if rest in ('all', ''):
            return [('gpu', i) for i in range(count)]
        ids = [_index(i, devices) for i in rest.split(',')]
        if max(ids) >= count:
            raise CaffeError('devices %r: GPU %d does not exist (%d visible)' % (devices, max(ids), count))
        return [('gpu', i) for i in ids]
    parsed = []
    for item in devices:             # in a list, 'cpu:4' is the device cpu:4, not four devices
        item = str(item)
        parsed.extend(parse_devices(item) if ',' in item or item.endswith(':all') else [_one(item)])
    if not parsed:
        _bad(devices)
    return parsed


def describe_devices(devices, replication=None):
    """Lines that name the devices of a run, in Caffe's words where Caffe has some (and,
    in a job of several processes, this process's place in it)."""
    ids = [index for kind, index in devices if kind == 'gpu']
    if not ids:
        if len(devices) == 1:
            lines = ['Use CPU.']
        else:
            lines = ['Using %d virtual CPU devices (threads) on %d CPU cores'
                     % (len(devices), os.cpu_count() or 1)]
    else:
        lines = ['Using GPUs %s' % ', '.join(map(str, ids))] + \
            ['GPU %d: %s' % (i, gpu_name(i)) for i in sorted(set(ids))]
    if replication is not None and replication.processes > 1:
        lines.append('Process %d of %d (MPI): replicas %d to %d of %d'
                     % (replication.process, replication.processes, replication.first,
                        replication.first + len(devices) - 1, replication.total))
    return lines


def gpu_name(index):
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(index)['name']
    return name.decode() if isinstance(name, bytes) else str(name)


def _index(text, devices):
    if not text.strip().isdigit():
        raise CaffeError('devices %r: %r is not a device number' % (devices, text))
    return int(text)


def _one(item):
    kind, _, index = str(item).partition(':')
    if kind not in ('cpu', 'gpu') or not index.isdigit():
        raise CaffeError("device %r: expected 'cpu:i' or 'gpu:i'" % (item,))
    return (kind, int(index))


def _bad(devices):
    raise CaffeError('devices %r: need at least one device' % devices)


class DevicePool:
    """One long-lived worker thread per device; ``run(fn)`` calls ``fn(rank)`` on each.

    A worker thread keeps its device current (a CUDA context is per thread), so a
    replica's work always happens on the same thread.
    """

    def __init__(self, devices, comms):
        self.devices = list(devices)
        self.comms = list(comms)
        self.size = len(self.devices)
        self._workers = [futures.ThreadPoolExecutor(1, thread_name_prefix='replica%d' % r)
                         for r in range(self.size)]

    def run(self, fn):
        """``[fn(0), ..., fn(R-1)]``, each on its replica's thread."""
        pending = [worker.submit(fn, rank) for rank, worker in enumerate(self._workers)]
        done, not_done = futures.wait(pending, return_when=futures.FIRST_EXCEPTION)
        failure = next((f.exception() for f in pending if f.done() and f.exception() is not None
                        and not isinstance(f.exception(), CommAborted)), None)
        if failure is None:
            failure = next((f.exception() for f in done if f.exception() is not None), None)
        if failure is None:
            return [f.result() for f in pending]
        for comm in self.comms:
            comm.abort(failure)
        _, stuck = futures.wait(not_done, timeout=ABORT_GRACE_SECONDS)
        original = next((f.exception() for f in pending if f.done() and f.exception() is not None
                         and not isinstance(f.exception(), CommAborted)), failure)
        if stuck:
            raise CaffeError('%d replica(s) did not stop within %.0f s after replica failure: %r'
                             % (len(stuck), ABORT_GRACE_SECONDS, original)) from original
        raise original

    def submit(self, rank, fn, *args):
        """Start ``fn(*args)`` on one replica's thread; its Future."""
        return self._workers[rank].submit(fn, *args)

    def run_on(self, rank, fn):
        """``fn()`` on one replica's thread (no collectives: nothing to abort)."""
        return self._workers[rank].submit(fn).result()

    def close(self):
        for worker in self._workers:
            worker.shutdown(wait=False)
