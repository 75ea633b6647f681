"""The input pipeline of a data-parallel run: ONE reader per data layer draws each global
batch in a prefetch thread and splits it over the replicas."""
import queue
import threading

import numpy as np

from ..backend.thread_start import start_thread


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
        self.replicas = replicas
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
            start_thread(thread, "the prefetch thread of data layer '%s'" % layer.name)
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
