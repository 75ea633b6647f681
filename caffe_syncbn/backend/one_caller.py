"""One caller at a time: a Net runs one pass at a time (its blobs hold one batch), and a
solver one step (its replicas take every step together). A second thread that calls in
meanwhile gets one CaffeError naming both threads, not blobs that two passes wrote in
turn. The thread that holds the guard may call in again (a step runs tests and
snapshots; pycaffe's forward runs a pass)."""
import contextlib
import functools
import threading

from ..errors import CaffeError


class OneCaller:
    """The guard of one object's calls; ``what`` names the object in the error ("net
    'lenet'") and ``advice`` says what to do instead."""

    def __init__(self, what, advice):
        self.what, self.advice = what, advice
        self._lock = threading.RLock()
        self._holder = None          # (thread name, call) of the outermost call

    @contextlib.contextmanager
    def call(self, name):
        if not self._lock.acquire(blocking=False):
            holder = self._holder        # None only if the holder is leaving just now
            raise CaffeError('%s: %s() in thread %s while %s: %s' % (
                self.what, name, _quoted(threading.current_thread().name),
                'thread %s is in %s()' % (_quoted(holder[0]), holder[1]) if holder
                else 'another thread calls it', self.advice))
        outermost = self._holder is None
        if outermost:
            self._holder = (threading.current_thread().name, name)
        try:
            yield
        finally:
            if outermost:
                self._holder = None
            self._lock.release()


def _quoted(name):
    return "'%s'" % name


def one_at_a_time(name):
    """A method decorator: the method runs under its object's ``_one_caller`` (a OneCaller),
    named ``name`` in the error."""
    def decorate(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            with self._one_caller.call(name):
                return method(self, *args, **kwargs)
        return guarded
    return decorate
