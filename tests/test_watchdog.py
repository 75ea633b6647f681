"""tests/helpers/watchdog.py, the hang detector of the suite: a genuine hang still fails (blocked
or spinning, a child or a grandchild, threads of this process), and leaves no process
behind; work that a loaded machine slows down is no hang."""
import os
import subprocess
import sys
import threading

import pytest
from helpers import watchdog

SLEEPER = 'import os, sys, time; open(sys.argv[1], "w").write(str(os.getpid())); time.sleep(1000)'


def ended(pid):
    """Whether process ``pid`` has ended (a zombie has)."""
    try:
        with open('/proc/%d/stat' % pid) as f:
            return f.read().rsplit(')', 1)[1].split()[0] == 'Z'
    except FileNotFoundError:
        return True


def check_killed(pid_file):
    pid = int(pid_file.read_text())
    watchdog.wait_until(lambda: ended(pid), 'SIGKILL to end process %d' % pid, stall=5)


def test_a_blocked_command_stalls_and_is_killed(tmp_path):
    with pytest.raises(watchdog.Hang, match=r'command python.* stalled: no progress'):
        watchdog.run([sys.executable, '-c', SLEEPER, str(tmp_path / 'pid')], stall=1)
    check_killed(tmp_path / 'pid')


def test_a_blocked_grandchild_stalls_and_its_session_is_killed(tmp_path):
    """mpiexec's case: the command waits for a child that waits for ever."""
    parent = ('import subprocess, sys; subprocess.call([sys.executable, "-c", sys.argv[1], '
              'sys.argv[2]])')
    with pytest.raises(watchdog.Hang, match='stalled'):
        watchdog.run([sys.executable, '-c', parent, SLEEPER, str(tmp_path / 'pid')], stall=1)
    check_killed(tmp_path / 'pid')


def test_a_spinning_command_spends_its_budget(tmp_path):
    with pytest.raises(watchdog.Hang, match=r'spinning: \d+ CPU seconds used, more than 0.5 s'):
        watchdog.run([sys.executable, '-c', 'while True: pass'], limit=0.5)


def test_threads_of_this_process_that_wait_for_ever_stall():
    never = threading.Event()
    thread = threading.Thread(target=never.wait, daemon=True)
    thread.start()
    with pytest.raises(watchdog.Hang, match='the waiting thread: stalled'):
        watchdog.wait_until(lambda: not thread.is_alive(), 'the waiting thread', stall=1)
    never.set()


def test_call_returns_the_result_or_raises_the_error():
    assert watchdog.call(lambda: 6 * 7, 'a product') == 42
    with pytest.raises(ZeroDivisionError):
        watchdog.call(lambda: 1 / 0, 'a division')


@pytest.mark.slow
def test_work_slowed_down_by_a_loaded_machine_is_no_hang(tmp_path):
    """Three busy processes per core load the machine (beside whatever else runs); a
    command that needs 3 CPU seconds then takes 10 s of wall time or more, several times
    the 3 s stall bound, and still passes: it never stops making progress. (The suite's
    bound is 30 s: a tenth of a CPU second in it is a third of a percent of a core.)"""
    spin = [subprocess.Popen([sys.executable, '-c', 'while True: pass'])
            for _ in range(3 * (os.cpu_count() or 1))]
    try:
        work = ('import time\nstart = time.process_time()\n'
                'while time.process_time() - start < 3: pass')
        done = watchdog.run([sys.executable, '-c', work], stall=3, limit=60)
    finally:
        for proc in spin:
            proc.kill()
            proc.wait()
    assert done.returncode == 0
