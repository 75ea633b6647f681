"""Run one function per rank on its own thread, as replicas run, and catch hangs."""
import threading

from helpers import watchdog


def run_threads(fn, n, limit=30.0):
    """fn(rank) on n threads at once; returns (results, errors) by rank. Fails with a
    watchdog.Hang if the threads stall or spin (``limit``: the seconds they may take on
    an idle machine) before all are done."""
    results, errors = [None] * n, [None] * n

    def target(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    watchdog.join(threads, '%d threads' % n, limit)
    return results, errors
