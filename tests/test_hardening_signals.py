"""SIGTERM (issue 34, item 9), what SLURM and Kubernetes send before SIGKILL: train writes
a snapshot and ends (-sigterm_effect snapshot, the default), ends as on SIGINT (stop), or
trains on (none); a run that SIGTERM ended exits 143. Real subprocesses, real signals; the
waits have generous bounds (another suite may run beside this one)."""
import os
import re
import signal
import subprocess
import sys

import pytest
from test_train_net import make_job

import caffe_syncbn as caffe
from caffe_syncbn.formats.solverstate import read_solver_state

from helpers import watchdog
from helpers.paths import ROOT

BOUND = 300


def train_until(folder, effect, after_train=True, signal_at='Iteration 2, loss', more=''):
    """Start train on 2 devices (``more`` added to the solver file), send SIGTERM once
    ``signal_at`` is logged; (exit status, stderr)."""
    solver = make_job(folder, batch=2, max_iter=60)
    solver.write_text(solver.read_text() + more)
    if not after_train:
        solver.write_text(solver.read_text().replace('snapshot_after_train: true',
                                                     'snapshot_after_train: false'))
    proc = subprocess.Popen([sys.executable, '-m', 'caffe_syncbn', 'train', '-solver', str(solver),
                             '-cpu_devices', '2', '-sigterm_effect', effect],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=subprocess.PIPE,
                            text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if signal_at in line:
            proc.send_signal(signal.SIGTERM)
            break
    seen += proc.stderr.readlines()
    return watchdog.wait(proc, 'the train command', limit=BOUND), ''.join(seen)


def snapshots(folder):
    return sorted(int(re.search(r'_iter_(\d+)\.', p.name).group(1))
                  for p in folder.glob('snap_iter_*.caffemodel'))


@pytest.mark.parametrize('after_train', [True, False])
def test_sigterm_writes_one_snapshot_then_ends_with_143(tmp_path, after_train):
    """Was: the run died at once (exit -15), nothing saved."""
    status, log = train_until(tmp_path, 'snapshot', after_train)
    assert status == 143, log[-3000:]
    taken = re.search(r'SIGTERM came [\d.]+ s ago; after iteration (\d+) the run snapshots, '
                      r'then stops', log)
    assert taken, log[-3000:]
    stopped_at = int(taken.group(1))
    assert 2 < stopped_at < 60
    assert snapshots(tmp_path) == [stopped_at]        # once, whatever snapshot_after_train says
    assert log.count('Snapshotting to binary proto file') == 1
    assert re.search(r'Stopped [\d.]+ s after SIGTERM \(SIGKILL follows it after 30 s by '
                     r'default\)', log) and 'Optimization stopped early.' in log
    net = caffe.Net(str(tmp_path / 'net.prototxt'), caffe.TEST,
                    weights=str(tmp_path / ('snap_iter_%d.caffemodel' % stopped_at)))
    assert net.params['conv'][0].data.shape == (4, 2, 3, 3)
    state = read_solver_state(str(tmp_path / ('snap_iter_%d.solverstate' % stopped_at)))
    assert state.iter == stopped_at


def test_sigterm_stop_ends_as_sigint_does(tmp_path):
    """stop: Caffe's stop, whose only snapshot is snapshot_after_train's (off here)."""
    status, log = train_until(tmp_path, 'stop', after_train=False)
    assert status == 143, log[-3000:]
    assert re.search(r'after iteration \d+ the run stops', log), log[-3000:]
    assert snapshots(tmp_path) == [] and 'Optimization stopped early.' in log


def test_sigterm_none_trains_on(tmp_path):
    status, log = train_until(tmp_path, 'none')
    assert status == 0, log[-3000:]
    assert 'SIGTERM' not in log and 'Optimization Done.' in log
    assert snapshots(tmp_path) == [60]


def test_sigterm_during_a_test_pass_is_taken_between_its_batches(tmp_path):
    """Tests take requests between batches, as Caffe's do: the snapshot comes at the
    iteration the test belongs to."""
    status, log = train_until(tmp_path, 'snapshot', signal_at='Testing net (#0)',
                              more='test_net: "%s"\ntest_iter: 2000\ntest_interval: 4\n'
                              % (tmp_path / 'net.prototxt'))
    assert status == 143, log[-3000:]
    assert 'Test interrupted.' in log
    assert snapshots(tmp_path) == [0]


def rank_process(launcher, rank):
    """The pid of the launched process of MPI rank ``rank`` (a descendant of ``launcher``)."""
    children = {}
    for entry in os.listdir('/proc'):
        try:
            with open('/proc/%s/stat' % entry) as f:
                children.setdefault(int(f.read().rsplit(')', 1)[1].split()[1]), []).append(
                    int(entry))
        except (OSError, ValueError, IndexError):
            continue
    pending = [launcher]
    while pending:
        pid = pending.pop()
        try:
            with open('/proc/%d/environ' % pid, 'rb') as f:
                environ = f.read().split(b'\0')
        except OSError:
            environ = []
        if b'PMI_RANK=%d' % rank in environ:
            return pid
        pending += children.get(pid, [])
    return None


@pytest.mark.slow
def test_a_sigterm_to_one_process_of_an_mpi_job_ends_every_process_at_the_same_iteration(
        tmp_path):
    """The processes agree on a request between iterations (data_parallel.requested_action):
    SIGTERM to rank 1 alone has process 0 write the snapshot, and all stop after it."""
    from test_mpi import MPIEXEC
    if MPIEXEC is None:
        pytest.skip('mpiexec not found')
    solver = make_job(tmp_path, batch=2, max_iter=100000)
    proc = subprocess.Popen([MPIEXEC, '-n', '2', sys.executable, '-m', 'caffe_syncbn', 'train',
                             '-solver', str(solver), '-cpu_devices', '1'],
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=subprocess.PIPE,
                            text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if 'Iteration 5, loss' in line:
            os.kill(rank_process(proc.pid, 1), signal.SIGTERM)
            break
    seen += proc.stderr.readlines()
    log = ''.join(seen)
    assert watchdog.wait(proc, 'the MPI job', limit=BOUND) != 0, log[-3000:]   # rank 1: 143
    assert 'error' not in log, log[-3000:]
    assert 'Optimization stopped early.' in log, log[-3000:]
    (stopped_at,) = snapshots(tmp_path)
    assert 5 <= stopped_at < 100000
    assert read_solver_state(str(tmp_path / ('snap_iter_%d.solverstate' % stopped_at))).iter \
        == stopped_at
