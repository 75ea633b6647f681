"""Data parallelism: one worker thread per device, each holding a replica Net.

The pool runs a function on every replica at once. If one replica raises, the pool
aborts the communicator, so replicas blocked in a collective raise promptly, and the
caller gets the ORIGINAL exception with its traceback.
"""
import concurrent.futures as futures
import os
import threading

import numpy as np

from .backend import gpu_count
from .comm.base import CommAborted
from .errors import CaffeError

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


def split_batch(arrays, parts):
    """Split each array along axis 0 into ``parts`` nearly equal, possibly empty, pieces."""
    return [list(piece) for piece in zip(*(np.array_split(a, parts) for a in arrays))] \
        if arrays else [[] for _ in range(parts)]


def read_parts(reader, sizes, shard=None):
    """The next ``sum(sizes)`` samples of ``reader`` as one batch per replica, replica k's
    of ``sizes[k]`` rows. A reader with ``next_batches(sizes)`` assembles each replica's
    batch itself, so shapes may differ between replicas (whole images of any size, one
    per device); otherwise one batch is read and split along axis 0.

    ``shard=(start, total)``: these rows are rows start... of a global batch of ``total``
    rows; the reader skips the others' rows before and after them without decoding."""
    start, total = shard or (0, sum(sizes))
    if start:
        reader.skip(start)
    if hasattr(reader, 'next_batches'):
        parts = reader.next_batches(sizes)
    else:
        parts = split_batch(reader.next_batch(sum(sizes)), len(sizes))
    if total > start + sum(sizes):
        reader.skip(total - start - sum(sizes))
    return parts


class InputPipeline:
    """ONE reader per data layer, drawing the GLOBAL batch (replicas x batch_size) in a
    prefetch thread, as one batch per replica.

    Across processes, ``place=(first, total)`` says that this process holds the global
    replicas first ... first + replicas - 1 of ``total``: its readers then decode only
    those replicas' rows of each global batch, and skip the rest. Their random draws come
    from ``rngs`` (one per layer), the same in every process, so the processes' shares
    make up exactly the global batch that one process would read.

    A layer that must not be read ahead (``prefetch = False``: MemoryData, whose arrays the
    user sets between steps) is read when its batch is asked for, in the caller's thread."""

    def __init__(self, data_layers, replicas, prefetch=2, place=None, rngs=None):
        import queue
        self.replicas = replicas
        self._layers = data_layers
        self._queues, self._unbuffered = {}, {}
        self._threads = []
        self._stop = threading.Event()
        first, total = place or (0, replicas)
        for layer, rng in zip(data_layers, rngs or [None] * len(data_layers)):
            reader = layer.make_reader(rng)
            sizes = [layer.batch_size] * replicas
            shard = (first * layer.batch_size, total * layer.batch_size)
            if not getattr(layer, 'prefetch', True):
                self._unbuffered[layer.name] = (reader, sizes, shard)
                continue
            q = queue.Queue(maxsize=prefetch)
            thread = threading.Thread(target=self._produce, args=(reader, sizes, shard, q),
                                      name='prefetch-%s' % layer.name, daemon=True)
            thread.start()
            self._queues[layer.name] = q
            self._threads.append(thread)

    def _produce(self, reader, sizes, shard, q):
        while not self._stop.is_set():
            try:
                item = read_parts(reader, sizes, shard)
            except Exception as exc:            # handed to the consumer, raised there
                item = exc
            while not self._stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except Exception:
                    continue
            if isinstance(item, Exception):
                return

    def next_split(self):
        """{layer name: [this replica's arrays] per replica} for the next global batch."""
        parts = [dict() for _ in range(self.replicas)]
        for name, q in self._queues.items():
            item = q.get()
            if isinstance(item, Exception):
                raise item
            for rank, piece in enumerate(item):
                parts[rank][name] = piece
        for name, (reader, sizes, shard) in self._unbuffered.items():
            for rank, piece in enumerate(read_parts(reader, sizes, shard)):
                parts[rank][name] = piece
        return parts

    def close(self):
        self._stop.set()
