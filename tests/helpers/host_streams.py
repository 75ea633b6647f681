"""HostStreams: the CPU stand-in of the communicators' CupyStreams, over numpy arrays,
with streams that can run their queued operations in any order a GPU could."""
import contextlib
import threading

import numpy as np


class HostStreams:
    """The CPU stand-in of CupyStreams: numpy "device" arrays and simulated streams.

    ``deferred=False``: every stream operation runs at once (host order).
    ``deferred=True``: operations queue on their stream; ``run(seed)`` executes them in a
    random interleaving where each stream keeps its order and a wait blocks its stream
    until the event's record has run, as on a GPU. ``launch(fn)`` enqueues any work
    (a producer "kernel") on the calling thread's stream.
    """

    def __init__(self, deferred=False):
        self.deferred = deferred
        self._local = threading.local()
        self._lock = threading.Lock()
        self._streams = []
        self.log = []                   # (stream name, op) in execution order

    def stream(self, name):
        stream = _SimStream(name)
        with self._lock:
            self._streams.append(stream)
        return stream

    def use(self, stream):
        """Make ``stream`` the calling thread's current stream."""
        self._local.stream = stream

    def is_device_array(self, array):
        return isinstance(array, np.ndarray)

    def current_stream(self):
        if getattr(self._local, 'stream', None) is None:
            self.use(self.stream(threading.current_thread().name))
        return self._local.stream

    def _enqueue(self, stream, op, fn, blocked_by=None):
        if not self.deferred:
            fn()
            with self._lock:
                self.log.append((stream.name, op))
            return
        with self._lock:
            stream.queue.append((op, fn, blocked_by))

    def record_event(self, stream):
        event = _SimEvent()
        self._enqueue(stream, 'record', event.set)
        return event

    def wait_event(self, stream, event):
        self._enqueue(stream, 'wait', lambda: None, blocked_by=event)

    def new_stream(self):
        return self.stream('side stream of %s' % threading.current_thread().name)

    def handle(self, stream):
        return stream

    def device_scope(self):
        return contextlib.nullcontext()

    def pointer(self, array):
        return array.ctypes.data

    def event_done(self, event):
        return event.is_set()

    def wait_host(self, event):
        if self.deferred and not event.is_set():
            raise RuntimeError('a host wait on a deferred stream would never end')

    def to_device(self, array):
        return np.array(array)

    def to_host(self, array, out):
        out[...] = array

    def empty(self, size, dtype, stream):
        return np.empty(size, dtype)

    def sum_into(self, out, arrays, stream):
        def add():
            total = arrays[0].reshape(-1).copy()
            for a in arrays[1:]:
                total += a.reshape(-1)
            out[...] = total
        self._enqueue(stream, 'sum', add)

    def copy(self, dst, src, stream):
        def assign():
            dst.reshape(-1)[...] = src.reshape(-1)
        self._enqueue(stream, 'copy', assign)

    def launch(self, fn, name='kernel'):
        self._enqueue(self.current_stream(), name, fn)

    def run(self, seed=0):
        """Execute every queued operation (deferred mode), in a random legal interleaving."""
        rng = np.random.RandomState(seed)
        with self._lock:
            while True:
                ready = [s for s in self._streams if s.queue and
                         (s.queue[0][2] is None or s.queue[0][2].is_set())]
                if not ready:
                    stuck = [(s.name, s.queue[0][0]) for s in self._streams if s.queue]
                    if stuck:
                        raise RuntimeError('streams wait on events never recorded: %s' % stuck)
                    return
                stream = ready[rng.randint(len(ready))]
                op, fn, _ = stream.queue.pop(0)
                fn()
                self.log.append((stream.name, op))


class _SimStream:
    def __init__(self, name):
        self.name = name
        self.queue = []

    def __repr__(self):
        return '<stream %s>' % self.name


class _SimEvent(threading.Event):
    pass
