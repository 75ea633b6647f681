"""Telling a hang from a slow machine: every hang detector of the tests goes through here.

A hang makes no progress. Work that is blocked (a FIFO that waits for a writer, a lock, a
message that never comes) uses no CPU; work that spins uses CPU without end. A loaded
machine slows work down but never stops it: a process that can run gets CPU in any few
seconds, at any load. So the bounds here are on progress, never on wall time:

* **stalled**: the watched processes (or threads) gained less than ``MIN_PROGRESS`` CPU
  seconds in the last ``STALL`` seconds;
* **spinning**: they used more CPU than the work may take: ``limit`` seconds, what it may
  take on an idle machine, on every core.

Either fails the test with a ``Hang`` naming what hung and how: a blocked hang within
``STALL`` seconds, a spinning one once its CPU budget is spent, at any load. The CPU of a
process counts that of its children (mpiexec's ranks, a tool's workers) too.
"""
import os
import signal
import subprocess
import tempfile
import threading
import time

STALL = 30.0
MIN_PROGRESS = 0.1
#: how often the work is asked whether it is done, and how often its CPU is read
POLL, SAMPLE = 0.05, 1.0
_TICK = os.sysconf('SC_CLK_TCK')


class Hang(AssertionError):
    """Work that stalled or spun (see the module docstring)."""


def _times(pid):
    """(parent pid, CPU seconds of the process and of its reaped children), or None."""
    try:
        with open('/proc/%d/stat' % pid, 'rb') as f:
            fields = f.read().rsplit(b')', 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), sum(int(v) for v in fields[11:15]) / _TICK


def tree_cpu(pid):
    """CPU seconds of process ``pid`` and of every process below it."""
    table = {}
    for name in os.listdir('/proc'):
        if name.isdigit():
            found = _times(int(name))
            if found is not None:
                table[int(name)] = found
    children = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    total, pending = 0.0, [pid]
    while pending:
        current = pending.pop()
        total += table.get(current, (0, 0.0))[1]
        pending += children.get(current, [])
    return total


def own_cpu():
    """CPU seconds of this process, all its threads."""
    return time.process_time()


class Watch:
    """Progress of the work whose CPU seconds ``cpu()`` gives; ``check()`` raises Hang."""

    def __init__(self, what, limit, cpu=own_cpu, stall=STALL):
        self.what, self.limit, self.cpu, self.stall = what, limit, cpu, stall
        self.budget = limit * (os.cpu_count() or 1)
        self.first = self.last = cpu()
        self.progressed = time.monotonic()

    def check(self):
        used = self.cpu()
        now = time.monotonic()
        if used - self.last >= MIN_PROGRESS:
            self.last, self.progressed = used, now
        if used - self.first > self.budget:
            raise Hang('%s: spinning: %.0f CPU seconds used, more than %g s on each of %d '
                       'cores' % (self.what, used - self.first, self.limit, os.cpu_count()))
        if now - self.progressed > self.stall:
            raise Hang('%s: stalled: no progress (under %g CPU seconds) in %g s'
                       % (self.what, MIN_PROGRESS, self.stall))


def wait_until(done, what, limit=60.0, cpu=own_cpu, stall=STALL):
    """Return once ``done()`` is true; a Hang if the work stalls or spins first."""
    watch = Watch(what, limit, cpu, stall)
    sampled = time.monotonic()
    while not done():
        if time.monotonic() - sampled >= SAMPLE:
            watch.check()
            sampled = time.monotonic()
        time.sleep(POLL)


def join(threads, what, limit=60.0):
    """Join ``threads`` (of this process); a Hang if they stall or spin first."""
    wait_until(lambda: not any(t.is_alive() for t in threads), what, limit)


def call(fn, what, limit=60.0):
    """``fn()`` on a thread of its own, watched: its result, its exception, or a Hang (the
    thread is left behind, as a daemon)."""
    outcome = {}

    def target():
        try:
            outcome['result'] = fn()
        except BaseException as exc:
            outcome['error'] = exc
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    join([thread], what, limit)
    if 'error' in outcome:
        raise outcome['error']
    return outcome['result']


def wait(proc, what=None, limit=120.0, stall=STALL):
    """``proc.wait()`` for a Popen, watched (with its children); on a Hang the process
    and its session are killed first."""
    what = what or 'process %s' % _name(proc.args)
    try:
        wait_until(lambda: proc.poll() is not None, what, limit,
                   lambda: tree_cpu(proc.pid), stall)
    except Hang:
        kill(proc)
        raise
    return proc.returncode


def kill(proc):
    """SIGKILL ``proc`` and, when it leads its own session, everything it started."""
    try:
        if os.getsid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()


def run(args, limit=120.0, capture_output=False, text=False, input=None, check=False,
        stall=STALL, **kwargs):
    """subprocess.run without its wall-clock timeout: the command and its children are
    watched (see the module docstring); a Hang names the command and ends with the tail
    of what it wrote on stderr."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        if capture_output:
            kwargs.update(stdout=out, stderr=err)
        stdin = subprocess.PIPE if input is not None else kwargs.pop('stdin', None)
        proc = subprocess.Popen(args, stdin=stdin, start_new_session=True, **kwargs)
        if input is not None:
            proc.stdin.write(input.encode() if text and isinstance(input, str) else input)
            proc.stdin.close()
        try:
            wait(proc, 'command %s' % _name(args), limit, stall)
        except Hang as exc:
            raise Hang('%s; its stderr ends: %s' % (exc, _read(err, True)[-2000:])) from None
        stdout, stderr = (_read(out, text), _read(err, text)) if capture_output else (None, None)
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, args, stdout, stderr)
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


def _read(f, text):
    f.seek(0)
    data = f.read()
    return data.decode('utf-8', 'replace') if text else data


def _name(args):
    words = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
    line = ' '.join(os.path.basename(w) if i < 2 else w for i, w in enumerate(words))
    return line if len(line) <= 160 else line[:157] + '...'
