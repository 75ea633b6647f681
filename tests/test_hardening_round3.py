"""Regression tests for issue #34, round three: HDF5 files whose values are in other files
(external storage, external links, virtual datasets), two runs with one snapshot prefix,
an address-space limit above 2**63 bytes, Python layers named by a path or by the base
class, and an LMDB cut short while it is read."""
import os
import resource
import select
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest
from helpers import watchdog
from helpers.fuzz_harness import Worker, short_folder

import caffe_syncbn as caffe
from caffe_syncbn.blob import checked_shape, memory_limit
from caffe_syncbn.data.datum import array_to_datum, write_lmdb
from caffe_syncbn.data.lmdbfile import LMDBFile
from caffe_syncbn.formats.caffemodel import read_weights
from caffe_syncbn.netparam.inputs import swap_data_layers_for_inputs
from caffe_syncbn.netparam.upgrade import load_net_param
from caffe_syncbn.pycaffe.caffe import get_solver

from helpers.messages import error_of, one_line
from helpers.paths import ROOT

#: generous: a hang is the failure these bounds catch, and a loaded machine is no hang
TIMEOUT = 120
#: a net that trains on no files (DummyData)
NET = '''layer { name: "data" type: "DummyData" top: "data" top: "target"
  dummy_data_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
'''


@pytest.fixture
def tmp_path():
    with short_folder() as folder:
        yield folder


@pytest.fixture(scope='module')
def worker():
    worker = Worker(limit=TIMEOUT)
    yield worker
    worker.close()


# ---- HDF5 files that read other files -----------------------------------------------------------
KINDS = ('external storage', 'external link', 'virtual dataset')
SECRET = 42.0


def other_file_dataset(group, name, shape, kind, target):
    """Dataset ``name`` of ``group`` whose float32 values are in the file ``target``: its
    raw bytes (external storage), or its dataset 'x' (an external link, a virtual dataset)."""
    if kind == 'external storage':
        size = 4 * int(np.prod(shape))
        group.create_dataset(name, shape, 'f4', external=[(str(target), 0, size)])
    elif kind == 'external link':
        group[name] = h5py.ExternalLink(str(target), 'x')
    else:
        layout = h5py.VirtualLayout(shape, 'f4')
        layout[...] = h5py.VirtualSource(str(target), 'x', shape)
        group.create_virtual_dataset(name, layout)


def target_file(folder, kind, target, shape):
    """A FIFO (which libhdf5 would wait on for good), or a regular file of SECRET values:
    raw bytes for external storage, an HDF5 file with dataset 'x' for the others."""
    path = folder / ('fifo' if target == 'fifo' else 'secret')
    if target == 'fifo':
        os.mkfifo(path)
    elif kind == 'external storage':
        path.write_bytes(np.full(shape, SECRET, np.float32).tobytes())
    else:
        with h5py.File(path, 'w') as f:
            f['x'] = np.full(shape, SECRET, np.float32)
    return path


def weights_case(folder, kind, target):
    path = folder / 'w.caffemodel.h5'
    with h5py.File(path, 'w') as f:
        layer = f.create_group('data/ip')
        layer['0'] = np.ones((2, 3), np.float32)
        other_file_dataset(layer, '1', (2,), kind, target_file(folder, kind, target, (2,)))
    return 'weights', {'path': str(path)}, [str(path), "'data/ip/1'"]


def solver_state_case(folder, kind, target):
    path = folder / 's.solverstate.h5'
    with h5py.File(path, 'w') as f:
        f['iter'] = np.array([3], np.int32)
        f['current_step'] = np.array([0], np.int32)
        history = f.create_group('history')
        history['0'] = np.zeros((2, 3), np.float32)
        other_file_dataset(history, '1', (2,), kind, target_file(folder, kind, target, (2,)))
    return 'solver_state', {'path': str(path)}, [str(path), "'history/1'"]


def hdf5_data_case(folder, kind, target):
    path = folder / 'd.h5'
    with h5py.File(path, 'w') as f:
        other_file_dataset(f, 'data', (4, 3), kind, target_file(folder, kind, target, (4, 3)))
        f['label'] = np.arange(4, dtype=np.float32)
    (folder / 'list.txt').write_text('%s\n' % path)
    model = folder / 'net.prototxt'
    model.write_text('layer { name: "h5" type: "HDF5Data" top: "data" top: "label" '
                     'hdf5_data_param { source: "%s" batch_size: 2 } }' % (folder / 'list.txt'))
    return 'net', {'model': str(model), 'forwards': 1}, ["layer 'h5'", str(path), "'data'"]


@pytest.mark.parametrize('target', ['regular file', 'fifo'])
@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('case', [weights_case, solver_state_case, hdf5_data_case],
                         ids=['weights', 'solverstate', 'HDF5Data'])
def test_hdf5_values_in_another_file_are_refused_naming_the_file_and_dataset(
        worker, tmp_path, case, kind, target):
    """libhdf5 reads such values from wherever the file points: a regular file loaded
    silently (any file the user can read, /dev/urandom, /dev/zero), a FIFO hung the reader
    for good. Each reader refuses them before reading, in a child process that a hang
    cannot hold."""
    reader, args, names = case(tmp_path, kind, target)
    answer = worker.run(reader, args)
    assert answer['outcome'] == 'CaffeError', answer
    message = one_line(answer['message'], *names)
    assert 'refused' in message and ('fifo' if target == 'fifo' else 'secret') in message


def test_soft_links_inside_the_file_still_load(tmp_path):
    """A name that leads elsewhere in the same file reads nothing outside it."""
    path = tmp_path / 'w.caffemodel.h5'
    with h5py.File(path, 'w') as f:
        layer = f.create_group('data/ip')
        f['kept'] = np.full(2, 5.0, np.float32)
        layer['0'] = np.ones((2, 3), np.float32)
        layer['1'] = h5py.SoftLink('/kept')
    weights = read_weights(str(path))
    np.testing.assert_array_equal(weights.blobs['ip'][1], np.full(2, 5.0, np.float32))


def test_deploy_shapes_come_from_an_h5_file_that_holds_its_values(tmp_path):
    """No false alarm: the check leaves a file of Caffe's layout alone."""
    with h5py.File(tmp_path / 'd.h5', 'w') as f:
        f['data'] = np.zeros((4, 3, 5), np.float32)
        f['label'] = np.zeros(4, np.float32)
    (tmp_path / 'list.txt').write_text('%s\n' % (tmp_path / 'd.h5'))
    (tmp_path / 'net.prototxt').write_text(
        'layer { name: "h5" type: "HDF5Data" top: "data" top: "label" '
        'hdf5_data_param { source: "%s" batch_size: 2 } }' % (tmp_path / 'list.txt'))
    net = swap_data_layers_for_inputs(load_net_param(str(tmp_path / 'net.prototxt')))
    assert [list(s.dim) for s in net.layer[0].input_param.shape] == [[2, 3, 5], [2]]


def test_deploy_shapes_do_not_follow_a_link_to_a_fifo(tmp_path):
    """Data layers swapped for Inputs (deploy, timing, drawing) take their shapes from the
    first listed .h5 file where it holds them itself; one whose names lead to other files
    gives the default shapes, where looking the names up waited on the FIFO for good."""
    case = hdf5_data_case(tmp_path, 'external link', 'fifo')
    script = ('import sys; from caffe_syncbn.netparam.inputs import swap_data_layers_for_inputs\n'
              'from caffe_syncbn.netparam.upgrade import load_net_param\n'
              'net = swap_data_layers_for_inputs(load_net_param(sys.argv[1]))\n'
              'print([list(s.dim) for s in net.layer[0].input_param.shape])\n')
    done = watchdog.run([sys.executable, '-c', script, case[1]['model']], capture_output=True,
                          text=True, limit=TIMEOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == '[[2, 1], [2]]'


# ---- one run per snapshot prefix ----------------------------------------------------------------
SOLVER = '''net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" max_iter: 2
snapshot: %d snapshot_prefix: "snap/run"
'''
HOLDER = ('import sys\nfrom caffe_syncbn import get_solver\n'
          'solver = get_solver("holder.prototxt")\n'
          'print("ready", flush=True)\nsys.stdin.readline()\n')


def solver_folder(folder, snapshot=1):
    """solver.prototxt (snapshots every ``snapshot`` iterations) and holder.prototxt (every
    iteration: it holds the prefix from its creation) on one prefix, snap/run."""
    (folder / 'net.prototxt').write_text(NET)
    (folder / 'solver.prototxt').write_text(SOLVER % snapshot)
    (folder / 'holder.prototxt').write_text(SOLVER % 1)
    (folder / 'snap').mkdir(exist_ok=True)
    return folder


class Holder:
    """Another process with a solver on ``folder``'s holder.prototxt, alive until ``end``."""

    def __init__(self, folder):
        self.process = subprocess.Popen([sys.executable, '-c', HOLDER], cwd=folder, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=dict(os.environ, PYTHONPATH=str(ROOT)))
        watchdog.wait_until(lambda: select.select([self.process.stdout], [], [], 0)[0] or
                            self.process.poll() is not None, 'the holding solver',
                            limit=TIMEOUT, cpu=lambda: watchdog.tree_cpu(self.process.pid))
        assert self.process.stdout.readline() == 'ready\n', 'no solver'
        self.pid = self.process.pid

    def end(self):
        self.process.stdin.write('done\n')
        self.process.stdin.close()
        assert watchdog.wait(self.process, 'the holding solver', limit=TIMEOUT) == 0

    def kill(self):
        self.process.kill()
        assert watchdog.wait(self.process, 'the killed solver') == -signal.SIGKILL


def test_a_second_run_on_one_prefix_is_one_line_naming_the_other_process(tmp_path, monkeypatch):
    """Another process's solver holds snap/run: a pycaffe solver and `caffe-syncbn train`
    on the same prefix are refused at their start, naming the prefix and that process;
    once it ends (and its lock file with it), the prefix is free again."""
    monkeypatch.chdir(solver_folder(tmp_path))
    holder = Holder(tmp_path)
    try:
        assert (tmp_path / 'snap' / 'run.lock').read_text().split()[0] == str(holder.pid)
        names = ('solver.prototxt: ', "snapshot prefix 'snap/run'", 'process %d' % holder.pid,
                 "'%s'" % (tmp_path / 'snap' / 'run.lock'))
        one_line(error_of(get_solver, 'solver.prototxt'), *names)
        done = watchdog.run([sys.executable, '-m', 'caffe_syncbn', 'train', '-solver',
                               'solver.prototxt'], capture_output=True, text=True,
                              limit=TIMEOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert done.returncode == 1
        lines = [line for line in done.stderr.splitlines() if line.startswith('error: ')]
        assert lines == [done.stderr.strip().splitlines()[-1]], done.stderr
        one_line(lines[0], *names)
        assert not list((tmp_path / 'snap').glob('run_iter_*'))
    finally:
        holder.end()
    assert not (tmp_path / 'snap' / 'run.lock').exists()
    with get_solver('solver.prototxt') as solver:
        solver.solve()
    assert (tmp_path / 'snap' / 'run_iter_2.caffemodel').is_file()


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, monkeypatch, caplog):
    """kill -9 leaves the lock file, but not the lock: the next run takes the file over and
    says whose it was."""
    monkeypatch.chdir(solver_folder(tmp_path))
    holder = Holder(tmp_path)
    holder.kill()
    assert (tmp_path / 'snap' / 'run.lock').read_text().split()[0] == str(holder.pid)
    solver = get_solver('solver.prototxt')
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == 'WARNING']
    one_line(warning, "snapshot prefix 'snap/run'", 'process %d' % holder.pid, "run.lock'")
    assert (tmp_path / 'snap' / 'run.lock').read_text().split()[0] == str(os.getpid())
    solver.close()
    assert not (tmp_path / 'snap' / 'run.lock').exists()


def test_a_solver_that_snapshots_only_when_asked_takes_the_prefix_then(tmp_path, monkeypatch):
    """snapshot: 0 holds nothing at creation (a pycaffe loop of step() writes nothing
    there), but solver.snapshot() and solve() (its final snapshot) take the prefix first."""
    monkeypatch.chdir(solver_folder(tmp_path, snapshot=0))
    solver = get_solver('solver.prototxt')
    holder = Holder(tmp_path)
    try:
        for action in (solver.snapshot, solver.solve):
            one_line(error_of(action), "snapshot prefix 'snap/run'", 'process %d' % holder.pid)
        assert not list((tmp_path / 'snap').glob('run_iter_*'))
    finally:
        holder.end()
    solver.snapshot()
    assert (tmp_path / 'snap' / 'run.lock').read_text().split()[0] == str(os.getpid())
    solver.close()


def test_solvers_of_one_process_share_its_hold_on_a_prefix(tmp_path, monkeypatch):
    """A script that builds a second solver on its solver file is one run: both work, and
    the lock file stays until the last of them is closed."""
    monkeypatch.chdir(solver_folder(tmp_path))
    first, second = get_solver('solver.prototxt'), get_solver('solver.prototxt')
    second.step(1)
    first.close()
    assert (tmp_path / 'snap' / 'run.lock').exists()
    second.close()
    assert not (tmp_path / 'snap' / 'run.lock').exists()


# ---- the memory limit ---------------------------------------------------------------------------
PHYSICAL = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


@pytest.mark.parametrize('soft', [-1024, resource.RLIM_INFINITY, 2 ** 64 - 1, 2 ** 64 - 1024,
                                  2 ** 63])
def test_rlimits_that_do_not_fit_a_signed_64_bit_number_are_no_limit(monkeypatch, soft):
    """`ulimit -v` of 2**53 KiB or more reaches Python as a negative number (-1024 for
    2**64 - 1024 bytes): it limits nothing, and every net was refused."""
    monkeypatch.setattr(resource, 'getrlimit', lambda kind: (soft, soft))
    assert memory_limit() == PHYSICAL
    assert checked_shape((2, 3)) == (2, 3)


def test_a_real_address_space_limit_still_counts(monkeypatch):
    monkeypatch.setattr(resource, 'getrlimit', lambda kind: (1 << 30, resource.RLIM_INFINITY))
    assert memory_limit() == min(1 << 30, PHYSICAL)


def test_a_net_builds_under_ulimit_v_above_2_to_the_63(tmp_path):
    (tmp_path / 'net.prototxt').write_text(NET)
    script = 'import caffe_syncbn as caffe; caffe.Net("net.prototxt", caffe.TEST); print("built")'
    done = watchdog.run(['bash', '-c', 'ulimit -v 18014398509481983 && "$0" -c "$1"',
                           sys.executable, script], cwd=tmp_path, capture_output=True, text=True,
                          limit=TIMEOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0 and done.stdout.strip() == 'built', done.stderr[-2000:]


# ---- Python layers ------------------------------------------------------------------------------
class OnlyReshape(caffe.Layer):
    """A layer class that leaves forward to the base class."""

    def reshape(self, bottom, top):
        top[0].reshape(2)


@pytest.mark.parametrize('module', ['../probe', '.layer', 'tests/probe', 'a..b', 'probe.py '])
def test_a_python_module_named_by_a_path_or_relatively_is_one_line(tmp_path, module):
    path = tmp_path / 'net.prototxt'
    path.write_text('layer { name: "py" type: "Python" top: "a" '
                    'python_param { module: "%s" layer: "Probe" } }' % module)
    one_line(error_of(caffe.Net, str(path), caffe.TEST), str(path), "layer 'py'",
             "python_param module '%s' is not a module name" % module)


@pytest.mark.parametrize('module, layer, missing', [
    ('caffe_syncbn.layer', 'Layer', 'reshape and forward of the layer contract: it is '
                                    'caffe.Layer itself'),
    ('caffe_syncbn', 'Layer', 'reshape and forward'),
    ('test_hardening_round3', 'OnlyReshape', 'does not implement forward of the layer contract')])
def test_a_python_layer_class_without_the_layer_contract_is_one_line(tmp_path, module, layer,
                                                                      missing):
    path = tmp_path / 'net.prototxt'
    path.write_text('layer { name: "py" type: "Python" top: "a" '
                    'python_param { module: "%s" layer: "%s" } }' % (module, layer))
    one_line(error_of(caffe.Net, str(path), caffe.TEST), str(path), "layer 'py'",
             'python_param %s.%s does not implement' % (module, layer), missing)


# ---- LMDB ---------------------------------------------------------------------------------------
def test_an_lmdb_cut_short_while_read_names_the_size_it_has_then(tmp_path):
    """The size at open (every page there) is not where a copy cut short afterwards ends."""
    images = np.random.RandomState(0).randint(0, 256, (300, 3, 8, 8)).astype(np.uint8)
    write_lmdb(str(tmp_path / 'db'), [[(b'%05d' % i, array_to_datum(image, i).SerializeToString())
                                       for i, image in enumerate(images)]])
    data = tmp_path / 'db' / 'data.mdb'
    database = LMDBFile(str(data))
    records = database.records()
    next(records)
    opened_size = database.size
    cut = 3 * database.page_size
    os.truncate(data, cut)
    message = error_of(lambda: [None for _ in records])
    one_line(message, str(data), 'it ends at byte %d, inside a page' % cut)
    assert str(opened_size) not in message



def test_a_hold_collected_while_another_prefix_is_taken_lets_go_without_a_deadlock(tmp_path):
    """A finalizer runs at any allocation, also in the middle of taking a lock (here in the
    handler of the takeover warning): the collected hold lets go as soon as the lock table
    is free, where waiting for the table on the same thread never ended."""
    script = '''
import gc, logging, os, sys
sys.path.insert(0, %r)
from caffe_syncbn.training.prefix_lock import PrefixLock
folder = sys.argv[1]
first = [PrefixLock()]
assert first[0].take(os.path.join(folder, 'a')) is None
with open(os.path.join(folder, 'b.lock'), 'w') as f:
    f.write('999999 elsewhere\\n')          # a killed run's file, with no lock on it


class CollectOnWarning(logging.Handler):
    def emit(self, record):
        first.clear()
        gc.collect()


logging.getLogger('caffe_syncbn').addHandler(CollectOnWarning())
second = PrefixLock()
assert second.take(os.path.join(folder, 'b')) is None
print(sorted(os.listdir(folder)))
''' % str(ROOT)
    done = watchdog.run([sys.executable, '-c', script, str(tmp_path)], limit=30,
                        capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split('\n')[0] == "['b.lock']"
