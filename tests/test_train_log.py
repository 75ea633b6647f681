"""The training log as Caffe's log tools read it, what it says at start, the progress bar
on a terminal, and what the first non-finite loss or gradient does.

BVLC's tools/extra/extract_seconds.py and parse_log.py cannot run in CI; the tests below
read the log as they do: whitespace fields, ``int(fields[0][1:3])`` for the month,
``fields[1].rfind('.')`` for the microseconds, seconds since the first 'Solving' line for
every line with 'Iteration', and their output and lr regexes."""
import datetime
import logging
import os
import re
import subprocess
import sys
import threading
import time

import h5py
import numpy as np
import pytest
from helpers import watchdog
from test_train_net import make_job

import caffe_syncbn as caffe
from caffe_syncbn.glog import GlogFormatter

from helpers.paths import ROOT

#: glog: severity, MMDD, HH:MM:SS.uuuuuu, thread id right-aligned in 5, file:line, '] '
GLOG_LINE = re.compile(r'^([IWEF])(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) ( {0,4}\d+) '
                       r'([\w.]+):(\d+)\] ')
#: parse_log.py's expressions
TRAIN_OUTPUT = re.compile(r'Train net output #(\d+): (\S+) = ([\.\deE+-]+)')
TEST_OUTPUT = re.compile(r'Test net output #(\d+): (\S+) = ([\.\deE+-]+)')
LEARNING_RATE = re.compile(r'lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)')


def bvlc_datetime(line, year):
    """A log line's time as extract_seconds.py computes it."""
    fields = line.strip().split()
    clock, fraction = fields[1][:fields[1].rfind('.')], fields[1][fields[1].rfind('.') + 1:]
    hour, minute, second = (int(x) for x in clock.split(':'))
    return datetime.datetime(year, int(fields[0][1:3]), int(fields[0][3:]), hour, minute, second,
                             int(fraction))


def run_cli(*args, cwd=None, **kwargs):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return watchdog.run([sys.executable, '-m', 'caffe_syncbn'] + [str(a) for a in args],
                        cwd=cwd, env=env, capture_output=True, text=True, limit=120, **kwargs)


# ---- the line --------------------------------------------------------------------------------
def test_glog_fields_as_bvlc_tools_split_them():
    when = datetime.datetime(2026, 11, 22, 21, 51, 57, 33123)
    record = logging.LogRecord('caffe_syncbn', logging.INFO, '/x/caffe_syncbn/solvers/solver.py',
                               218, 'Iteration %d, lr = %g', (100, 0.01), None)
    record.created = when.timestamp()
    line = GlogFormatter().format(record)
    assert line == 'I1122 21:51:57.033123 %5d solver.py:218] Iteration 100, lr = 0.01' \
        % threading.get_native_id()
    assert bvlc_datetime(line, 2026) == when          # 33123 microseconds, not 33 milliseconds
    assert LEARNING_RATE.search(line).group(1) == '0.01'
    record = logging.LogRecord('caffe_syncbn', logging.WARNING, 'training.py', 7,
                               'first\nsecond', (), None)
    lines = GlogFormatter().format(record).split('\n')
    assert [GLOG_LINE.match(x).group(1) for x in lines] == ['W', 'W']   # each line prefixed
    assert [x.split('] ', 1)[1] for x in lines] == ['first', 'second']


# ---- a training log --------------------------------------------------------------------------
SOLVER = '''net: "%(net)s"
test_iter: 2 test_interval: 5 display: 2 max_iter: 10 snapshot: 5
base_lr: 0.05 momentum: 0.9 lr_policy: "step" gamma: 0.5 stepsize: 4
random_seed: 3 snapshot_prefix: "%(prefix)s"
'''


def test_training_log_reads_as_caffes(tmp_path):
    make_job(tmp_path, batch=4)
    solver = tmp_path / 'solver.prototxt'
    solver.write_text(SOLVER % {'net': tmp_path / 'net.prototxt', 'prefix': tmp_path / 'snap'})
    started = time.time()
    result = run_cli('train', '-solver=%s' % solver, '--cpu_devices', 2, '-sync_bn',
                     '-log_file', tmp_path / 'train.log', cwd=tmp_path)
    wall = time.time() - started
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / 'train.log').read_text().splitlines()
    assert lines == result.stderr.splitlines()               # no bar: stderr is no terminal
    for line in lines:
        match = GLOG_LINE.match(line)
        assert match and len(match.group(8)) >= 5, line
    # the start: devices, SyncBN, the net and its build time, the batch
    text = '\n'.join(lines)
    for expected in [r'\] Using 2 virtual CPU devices \(threads\)',
                     r'\] --sync-bn: 1 layer\(s\) run as SyncBN \(1 BatchNorm\+Scale\)',
                     r"\] Network initialization done: train net 'tiny', \d+ layers, \d+ "
                     r'parameters \(x 2 replicas\), in [\d.]+ s',
                     r"\] Batch of data layer 'data': 4 per device x 2 device\(s\) = 8 per forward",
                     r'\] Snapshot of iteration 5 written: [\d.e+-]+ MB in [\d.]+ s']:
        assert re.search(expected, text), expected
    # file:line is where the line was logged
    source = (ROOT / 'caffe_syncbn' / 'training' / 'solver.py').read_text().splitlines()
    for line in lines:
        if re.search(r'\] Iteration \d+, loss = ', line):
            file_name, number = GLOG_LINE.match(line).group(9, 10)
            assert file_name == 'solver.py' and "'Iteration %d, loss" in source[int(number) - 1]
    # extract_seconds: seconds since 'Solving' on every 'Iteration' line
    year = datetime.date.today().year
    start = bvlc_datetime(next(line for line in lines if 'Solving' in line), year)
    seconds = [(bvlc_datetime(line, year) - start).total_seconds()
               for line in lines if 'Iteration' in line]
    assert len(seconds) > 10 and seconds == sorted(seconds) and seconds[0] >= 0
    assert seconds[-1] < wall
    # parse_log: train and test outputs, learning rates
    train = [TRAIN_OUTPUT.search(line).groups() for line in lines if TRAIN_OUTPUT.search(line)]
    assert [name for _, name, _ in train] == ['loss'] * 5           # iterations 0, 2, ..., 8
    assert len([line for line in lines if TEST_OUTPUT.search(line)]) == 3     # at 0, 5, 10
    rates = [float(LEARNING_RATE.search(line).group(1)) for line in lines
             if LEARNING_RATE.search(line)]
    assert rates == [0.05, 0.05, 0.025, 0.025, 0.0125]


@pytest.mark.parametrize('terminal', ['stderr', 'stdout'])
def test_the_progress_bar_never_runs_into_a_log_line(tmp_path, terminal):
    """Run train on a pseudo-terminal, replay what it wrote as a terminal shows it ('\\r'
    returns to the start of the line, characters overwrite): every log line stands alone.
    With stderr sent to a file, the bar shows on stdout, and the file gets the log alone."""
    import fcntl
    import pty
    import struct
    import termios
    make_job(tmp_path, batch=4, max_iter=30)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack('HHHH', 40, 100, 0, 0))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = open(tmp_path / 'stderr.log', 'w')
    proc = subprocess.Popen([sys.executable, '-m', 'caffe_syncbn', 'train', '-solver',
                             str(tmp_path / 'solver.prototxt'), '-cpu_devices', '2'],
                            stdin=slave, stdout=slave, stderr=slave if terminal == 'stderr' else log,
                            env=env, cwd=tmp_path)
    os.close(slave)
    log.close()
    written = b''
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:                        # EIO: the child closed the terminal
            break
        if not chunk:
            break
        written += chunk
    os.close(master)
    assert watchdog.wait(proc, limit=120) == 0, written.decode(errors='replace')[-3000:]
    assert any(re.search(r'\d+/30 \[', line) for line in written.decode().split('\r')), \
        'no progress bar was drawn'
    if terminal == 'stdout':
        written = (tmp_path / 'stderr.log').read_bytes()
        assert b'\r' not in written and b'/30 [' not in written
    screen = terminal_lines(written.decode('utf-8', errors='replace'))
    logged = [line for line in screen if re.search(r'[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6}', line)]
    assert len(logged) > 30
    for line in logged:
        assert GLOG_LINE.match(line) and '|' not in line and 'it/s' not in line, repr(line)
    assert any('Iteration 29, loss' in line for line in logged)


def terminal_lines(text):
    """The lines a terminal shows for ``text`` ('\\r' to column 0, overwrite, '\\n' down)."""
    text = re.sub(r'\x1b\[[0-9;]*[A-Za-z]', '', text)       # cursor moves: one bar, unused
    lines, line, column = [], [], 0
    for char in text:
        if char == '\n':
            lines.append(''.join(line).rstrip())
            line, column = [], 0
        elif char == '\r':
            column = 0
        else:
            line[column:column + 1] = [char]
            column += 1
    return lines + [''.join(line).rstrip()]


# ---- non-finite losses and gradients ---------------------------------------------------------
def nan_job(folder):
    """Training whose iteration 2 reads a NaN (rows 8..11 on 2 devices x 2)."""
    solver = make_job(folder, batch=2, max_iter=4, rows=16)
    with h5py.File(folder / 'data.h5', 'r+') as f:
        data = f['data'][...]
        data[9, 0, 0, 0] = np.nan
        f['data'][...] = data
    return solver


@pytest.mark.parametrize('effect', ['none', 'snapshot', 'stop'])
def test_first_non_finite_loss(tmp_path, effect):
    solver = nan_job(tmp_path)
    result = run_cli('train', '-solver', solver, '-cpu_devices', 2, '-sync_bn',
                     '-nan_effect', effect)
    assert result.returncode == (3 if effect == 'stop' else 0), result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith('W')]
    # SyncBN keeps its running statistics at each batch whose statistics are NaN, and says so
    skips = [line for line in warnings if 'running statistics' in line]
    warnings = [line for line in warnings if line not in skips]
    assert "] Iteration 2: layer 'bn' kept its running statistics" in skips[0], skips
    assert len(warnings) == 1 and re.search(r'solver\.py:\d+\] Iteration 2: the loss \(nan\) is '
                                            r'not finite \(first time\)', warnings[0]), warnings
    snapshots = sorted(p.name for p in tmp_path.glob('snap_iter_*.caffemodel'))
    assert snapshots == {'none': ['snap_iter_4.caffemodel'],
                         'snapshot': ['snap_iter_2.caffemodel', 'snap_iter_4.caffemodel'],
                         'stop': ['snap_iter_2.caffemodel']}[effect]
    assert ('Optimization stopped early.' in result.stderr) == (effect == 'stop')
    if effect != 'none':            # the weights before the update that the NaN would spoil
        net = caffe.Net(str(tmp_path / 'net.prototxt'), caffe.TEST,
                        weights=str(tmp_path / 'snap_iter_2.caffemodel'))
        assert all(np.isfinite(b.data).all() for blobs in net.params.values() for b in blobs)
        from caffe_syncbn.formats.solverstate import read_solver_state
        assert read_solver_state(str(tmp_path / 'snap_iter_2.solverstate')).iter == 2


@pytest.mark.filterwarnings('ignore::RuntimeWarning')
def test_non_finite_gradient_of_a_finite_loss_is_named(tmp_path):
    """sqrt at 0: the loss is finite, its gradient is not; the warning names the layer."""
    (tmp_path / 'net.prototxt').write_text('''
        layer { name: "in" type: "Input" top: "x" top: "t"
                input_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 } } }
        layer { name: "ip" type: "InnerProduct" bottom: "x" top: "h"
                inner_product_param { num_output: 2 } }
        layer { name: "root" type: "Power" bottom: "h" top: "r" power_param { power: 0.5 } }
        layer { name: "loss" type: "EuclideanLoss" bottom: "r" bottom: "t" top: "loss" }''')
    (tmp_path / 'solver.prototxt').write_text(
        'net: "%s"\nbase_lr: 0.1 lr_policy: "fixed" max_iter: 5 display: 0\n'
        'snapshot_prefix: "%s"\n' % (tmp_path / 'net.prototxt', tmp_path / 'snap'))
    solver = caffe.get_solver(str(tmp_path / 'solver.prototxt'))
    rng = np.random.RandomState(0)
    solver.set_data_source(lambda: {'x': rng.rand(4, 3), 't': rng.rand(4, 2) + 1})
    solver.nan_effect = 'stop'
    before = [b.data.copy() for b in solver.net.params['ip']]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger('caffe_syncbn')
    logger.addHandler(handler)
    try:
        solver.step(3)
    finally:
        logger.removeHandler(handler)
        solver.close()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert warnings == ["Iteration 0: the gradient of layer 'ip' (param 0) is not finite (first "
                        'time); training stops before this update, as on a stop signal'], warnings
    assert solver.iter == 0 and solver.requested_early_exit
    for blob, old in zip(solver.net.params['ip'], before):
        np.testing.assert_array_equal(blob.data, old)
