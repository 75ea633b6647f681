"""Run one function per rank on its own thread, as replicas run, and catch hangs."""
import threading
import time


def run_threads(fn, n, timeout=30.0):
    """fn(rank) on n threads at once; returns (results, errors) by rank. Fails if a thread
    is still running after ``timeout`` seconds (a hang)."""
    results, errors = [None] * n, [None] * n

    def target(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), 'threads still running after %g s' % timeout
    return results, errors
