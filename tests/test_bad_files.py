"""Regression tests: each crash, leaked exception and silent weight loss that the fuzzing
campaign found, and the snapshot failures, as a case of its own. Inputs that used to kill
the process run in the fuzz worker's child process (tests/helpers/fuzz_harness.py)."""
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys

import h5py
import numpy as np
import pytest
from helpers import watchdog
from helpers.fuzz_harness import Worker, short_folder, top_level_cuts

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.formats.atomic import atomic_write, remove_stale_temporaries
from caffe_syncbn.pycaffe.caffe import get_solver

from helpers.messages import error_of, one_line
from helpers.paths import GOLDEN, ROOT, require


@pytest.fixture
def tmp_path():
    with short_folder() as folder:
        yield folder


@pytest.fixture(scope='module')
def worker():
    worker = Worker()
    yield worker
    worker.close()


def write(path, text):
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return str(path)


# ---- LMDB: no crash from a file -------------------------------------------------------------
DATA_NET = '''layer { name: "data" type: "Data" top: "data" top: "label"
  data_param { source: "%s" batch_size: 4 backend: LMDB } }
'''


def lmdb_copy(tmp_path, data=None):
    folder = tmp_path / 'db'
    folder.mkdir()
    source = require(GOLDEN / 'datum_lmdb' / 'data.mdb').read_bytes()
    write(folder / 'data.mdb', source if data is None else data(source))
    return folder, write(tmp_path / 'net.prototxt', DATA_NET % folder)


def test_lmdb_shorter_than_its_pages_is_an_error_not_sigbus(worker, tmp_path):
    folder, model = lmdb_copy(tmp_path, lambda data: data[:8192])
    answer = worker.run('net', {'model': model, 'forwards': 3})
    assert answer['outcome'] == 'CaffeError', answer
    one_line(answer['message'], folder / 'data.mdb', 'truncated', "layer 'data'")


def test_lmdb_record_with_a_damaged_size_is_an_error_not_sigbus(worker, tmp_path):
    """A record on overflow pages whose size field claims 4 GB: LMDB itself would read
    past the end of the file."""
    from caffe_syncbn.data.datum import array_to_datum, write_lmdb
    rs = np.random.RandomState(0)
    folder = tmp_path / 'db'
    write_lmdb(str(folder), [[(b'%08d' % i, array_to_datum(
        rs.randint(0, 256, (3, 40, 40)).astype(np.uint8)).SerializeToString()) for i in range(8)]])
    data = bytearray((folder / 'data.mdb').read_bytes())
    leaf = 2 * 4096                          # the root leaf: page 2
    first_node = struct.unpack_from('<H', data, leaf + 16)[0]
    struct.pack_into('<HH', data, leaf + first_node, 0xFFFF, 0xFFFF)
    (folder / 'data.mdb').write_bytes(bytes(data))
    model = write(tmp_path / 'net.prototxt', DATA_NET % folder)
    answer = worker.run('net', {'model': model})
    assert answer['outcome'] == 'CaffeError', answer
    one_line(answer['message'], folder / 'data.mdb', '4294967295 bytes')
    answer = worker.run('image_mean', {'path': str(folder)})
    assert answer['outcome'] == 'CaffeError', answer


def current_meta(data, page_size=4096):
    """The offset of the meta page in force: of the two, the one of the later transaction."""
    return max((0, page_size), key=lambda at: struct.unpack_from('<Q', data, at + 144)[0])


def without_root(data):
    """Both meta pages say the main database has no tree, but keep its record count."""
    data = bytearray(data)
    for meta in (0, 4096):
        struct.pack_into('<Q', data, meta + 128, 2 ** 64 - 1)
    return bytes(data)


@pytest.mark.parametrize('damage, words', [
    (lambda d: d[:4096 * 2] + bytes(4096), 'page 2 says it is page 0'),        # CorruptedError
    (lambda d: d[:128] + struct.pack('<Q', 7) + d[136:], 'root page 7'),      # PageNotFound
    (lambda d: d[:16] + b'\0\0\0\0' + d[20:], 'not an LMDB data file'),
    (lambda d: without_root(d), 'records but has no tree'),
])
def test_damaged_lmdb_is_one_error(tmp_path, damage, words):
    folder, model = lmdb_copy(tmp_path, damage)
    message = error_of(lambda: caffe.Net(model, caffe.TEST).forward())
    one_line(message, folder / 'data.mdb', words)


def test_lmdb_branch_pointing_past_the_file_is_one_error(tmp_path):
    from caffe_syncbn.data.datum import LMDBReader, write_lmdb
    folder = tmp_path / 'db'
    write_lmdb(str(folder), [[(b'%08d' % i, bytes(100)) for i in range(200)]])
    data = bytearray((folder / 'data.mdb').read_bytes())
    root = struct.unpack_from('<Q', data, current_meta(data) + 128)[0]   # a branch page
    first_node = struct.unpack_from('<H', data, root * 4096 + 16)[0]
    struct.pack_into('<HHH', data, root * 4096 + first_node, 0xFFFF, 0xFFFF, 0xFFFF)
    (folder / 'data.mdb').write_bytes(bytes(data))
    message = error_of(lambda: LMDBReader(str(folder)).next_records(3))
    one_line(message, folder / 'data.mdb', 'points to page 281474976710655, outside pages')


def test_lmdb_is_still_read_as_caffe_wrote_it(tmp_path):
    """The golden LMDB's records, in key order, and their count."""
    from caffe_syncbn.data.datum import LMDBReader
    reader = LMDBReader(str(require(GOLDEN / 'datum_lmdb')))
    keys = [key for key, _ in reader.records()]
    assert keys == [b'%08d' % i for i in range(10)] and reader.size == 10
    assert [key for key, _ in reader.next_records(13)] == keys + keys[:3]


def test_encoded_datum_with_an_empty_payload(tmp_path):
    from caffe_syncbn.data.datum import datum_to_array
    message = error_of(datum_to_array, caffe_pb2.Datum(encoded=True), where='record 7 of db')
    one_line(message, 'record 7 of db', '0 bytes')


# ---- weights: no silent loss ----------------------------------------------------------------
def test_caffemodel_cut_at_a_layer_boundary_is_reported(tmp_path, caplog):
    """Every cut of a real caffemodel between layers: an error, or a warning that names
    the layers left with their fillers' values and says where the file ends."""
    model = str(require(GOLDEN / 'net_lenet.prototxt'))
    full = caffe_pb2.NetParameter.FromString((GOLDEN / 'net_lenet.caffemodel').read_bytes())
    with_params = [layer.name for layer in full.layer if layer.blobs]
    for kept, data in top_level_cuts((GOLDEN / 'net_lenet.caffemodel').read_bytes()):
        path = write(tmp_path / ('cut%d.caffemodel' % kept), data)
        stored = [layer.name for layer in caffe_pb2.NetParameter.FromString(data).layer]
        lost = [name for name in with_params if name not in stored]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger='caffe_syncbn'):
            try:
                caffe.Net(model, caffe.TEST, weights=path)
            except CaffeError as exc:
                assert len(lost) == len(with_params), exc       # only when nothing loads
                one_line(str(exc), path, 'cut short')
                continue
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        if lost:
            assert len(warnings) == 1, warnings
            one_line(warnings[0], path, 'ends at layer %r' % stored[-1], 'cut short', *lost)
        else:
            assert not warnings


def test_loading_reports_ignored_and_missing_layers(tmp_path, caplog):
    """Caffe's "Ignoring source layer" (info) for layers the net lacks; one warning
    naming the net's layers with params that got nothing; nothing loaded is an error."""
    text = require(GOLDEN / 'net_lenet.prototxt').read_text()
    renamed = write(tmp_path / 'new_head.prototxt', text.replace('"ip2"', '"ip2_new"'))
    weights = str(GOLDEN / 'net_lenet.caffemodel')
    with caplog.at_level(logging.INFO, logger='caffe_syncbn'):
        net = caffe.Net(renamed, caffe.TEST, weights=weights)
    assert 'Ignoring source layer ip2' in caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'ip2_new'" in warnings[0] and 'ends at' not in warnings[0]
    reference = caffe.Net(str(GOLDEN / 'net_lenet.prototxt'), caffe.TEST, weights=weights)
    np.testing.assert_array_equal(net.params['ip1'][0].data, reference.params['ip1'][0].data)
    other = caffe_pb2.NetParameter.FromString(open(weights, 'rb').read())
    for layer in other.layer:
        layer.name += '_x'
    other_path = write(tmp_path / 'other.caffemodel', other.SerializeToString())
    one_line(error_of(caffe.Net, str(GOLDEN / 'net_lenet.prototxt'), caffe.TEST,
                      weights=other_path), other_path, 'no layer of it fits', "'conv1_x'")


def test_solverstate_of_another_net_names_both_files(tmp_path, monkeypatch):
    """The issue's case: a learned_net with other layer names resumed with fresh weights."""
    require(GOLDEN / 'solver_snapshot_binaryproto_iter_6.solverstate')
    monkeypatch.chdir(tmp_path)
    for path in GOLDEN.glob('solver_snapshot_binaryproto*'):
        shutil.copy(path, tmp_path)
    other = caffe_pb2.NetParameter.FromString(
        (tmp_path / 'solver_snapshot_binaryproto_iter_6.caffemodel').read_bytes())
    for layer in other.layer:
        layer.name += '_other'
    write(tmp_path / 'other.caffemodel', other.SerializeToString())
    state = caffe_pb2.SolverState.FromString(
        (tmp_path / 'solver_snapshot_binaryproto_iter_6.solverstate').read_bytes())
    state.learned_net = 'other.caffemodel'
    state_path = write(tmp_path / 'other.solverstate', state.SerializeToString())
    solver = get_solver('solver_snapshot_binaryproto.solver.prototxt')
    one_line(error_of(solver.restore, state_path), state_path, 'other.caffemodel',
             'no layer of it fits')
    assert solver.iter == 0
    shapes = caffe_pb2.NetParameter()
    shapes.CopyFrom(other)
    for layer in shapes.layer:
        layer.name = layer.name[:-len('_other')]
    shapes.layer[1].blobs[0].shape.dim[0] += 1                # conv1: one filter more
    write(tmp_path / 'other.caffemodel', shapes.SerializeToString())
    one_line(error_of(solver.restore, state_path), state_path, 'other.caffemodel', "'conv1'")


def test_solverstate_with_current_step_out_of_range(tmp_path, monkeypatch):
    require(GOLDEN / 'solver_snapshot_binaryproto_iter_6.solverstate')
    monkeypatch.chdir(tmp_path)
    for path in GOLDEN.glob('solver_snapshot_binaryproto*'):
        shutil.copy(path, tmp_path)
    state = caffe_pb2.SolverState.FromString(
        (tmp_path / 'solver_snapshot_binaryproto_iter_6.solverstate').read_bytes())
    for step in (-2 ** 31, 3):
        state.current_step = step
        path = write(tmp_path / 'bad.solverstate', state.SerializeToString())
        solver = get_solver('solver_snapshot_binaryproto.solver.prototxt')
        one_line(error_of(solver.restore, path), path, 'current_step %d' % step, '0..2')


def test_corrupt_hdf5_weights_single_bit_flips(worker, tmp_path):
    """Every 37th bit of a Caffe HDF5 weights file flipped on its own: a CaffeError
    naming the file, or a load, never another exception."""
    data = require(GOLDEN / 'format_hdf5_caffemodel.caffemodel.h5').read_bytes()
    model = str(GOLDEN / 'format_hdf5_caffemodel.prototxt')
    outcomes = set()
    for bit in range(0, len(data) * 8, 37 * 8 + 3):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        path = write(tmp_path / 'flip.caffemodel.h5', bytes(flipped))
        answer = worker.run('net', {'model': model, 'weights': path})
        assert answer['outcome'] in ('accepted', 'CaffeError'), answer
        if answer['outcome'] == 'CaffeError':
            one_line(answer['message'], path)
        outcomes.add(answer['outcome'])
    assert outcomes == {'accepted', 'CaffeError'}


def test_hdf5_dataset_declaring_terabytes_is_refused_before_reading(tmp_path):
    path = tmp_path / 'huge.caffemodel.h5'
    shutil.copy(require(GOLDEN / 'format_hdf5_caffemodel.caffemodel.h5'), path)
    path.chmod(0o644)
    with h5py.File(path, 'r+') as f:
        del f['data/conv1/0']
        f['data/conv1'].create_dataset('0', shape=(2 ** 40,), dtype='f4', chunks=(1024,))
    message = error_of(caffe.Net, str(GOLDEN / 'format_hdf5_caffemodel.prototxt'), caffe.TEST,
                       weights=str(path))
    one_line(message, path, "layer 'conv1' blob 0", 'TiB')


# ---- prototxt: one line, never an exception -------------------------------------------------
NET = 'name: "x"\nlayer { name: "in" type: "Input" top: "data" %s input_param { shape { %s } } }\n'


def test_latin1_byte_in_a_comment_loads_and_elsewhere_names_file_line(tmp_path):
    path = write(tmp_path / 'net.prototxt',
                 b'# r\xe9seau de Fran\xe7ois\n' + (NET % ('', 'dim: 2')).encode())
    assert caffe.Net(path, caffe.TEST).blobs['data'].shape == (2,)
    bad = write(tmp_path / 'bad.prototxt', (NET % ('', 'dim: 2')).encode().replace(
        b'name: "in"', b'name: "caf\xe9"'))
    one_line(error_of(caffe.Net, bad, caffe.TEST), '%s:2:19:' % bad, 'byte 0xe9', 'UTF-8')


def test_latin1_in_solver_through_train_net_is_one_line(tmp_path):
    """The issue's case: a UnicodeDecodeError traceback from tools/train_net.py."""
    write(tmp_path / 'net.prototxt', NET % ('', 'dim: 2 dim: 3'))
    write(tmp_path / 'solver.prototxt', b'net: "net.prototxt"  # r\xe9seau\nbase_lr: 0.1\n'
          b'lr_policy: "fixed"\nmax_iter: 0\nsnapshot_prefix: "caf\xe9"\n')
    done = watchdog.run([sys.executable, str(ROOT / 'tools' / 'train_net.py'), '--solver',
                         'solver.prototxt'], cwd=tmp_path, capture_output=True, text=True,
                        limit=120)
    assert done.returncode == 1 and 'Traceback' not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    one_line(last, 'error: solver.prototxt:5:', 'byte 0xe9')


@pytest.mark.parametrize('dims, words', [
    ('dim: 100000000000', ['needs 372.5 GiB (400000000000 bytes)', 'memory limit']),
    ('dim: -1', ['negative axis']),
    ('dim: 3 dim: 0 dim: -4', ['negative axis']),
])
def test_input_dims_are_checked_before_allocation(tmp_path, dims, words):
    path = write(tmp_path / 'net.prototxt', NET % ('', dims))
    one_line(error_of(caffe.Net, path, caffe.TEST), path, "layer 'in' (type Input)", *words)


def test_net_memory_limit_names_the_layer_and_bytes(tmp_path):
    from caffe_syncbn.blob import set_memory_limit
    path = write(tmp_path / 'net.prototxt', NET % ('', 'dim: 1000 dim: 1000') + '''
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 1000 } }''')
    set_memory_limit(6 << 20)
    try:
        message = error_of(caffe.Net, path, caffe.TEST)
    finally:
        set_memory_limit(None)
    one_line(message, path, "layer 'ip'", "the net's blobs up to this layer need 11.4 MiB")


def test_net_memory_limit_counts_views_once(tmp_path):
    """Flatten, Reshape and Split tops are views of their bottom: 4 MB of data, once."""
    from caffe_syncbn.blob import set_memory_limit
    path = write(tmp_path / 'net.prototxt', NET % ('', 'dim: 1000 dim: 1000') + '''
layer { name: "f" type: "Flatten" bottom: "data" top: "f" }
layer { name: "r" type: "Reshape" bottom: "f" top: "r" reshape_param { shape { dim: -1 } } }
layer { name: "s" type: "Split" bottom: "r" top: "s1" top: "s2" top: "s3" }''')
    set_memory_limit(5 << 20)
    try:
        assert caffe.Net(path, caffe.TEST).blobs['s3'].count == 10 ** 6
    finally:
        set_memory_limit(None)


def test_same_layer_name_with_one_and_two_bottoms(tmp_path):
    """The issue's IndexError at net.py:201 (Caffe accepts repeated layer names)."""
    path = write(tmp_path / 'net.prototxt', NET % ('top: "b"', 'dim: 2 dim: 3') + '''
layer { name: "x" type: "ReLU" bottom: "data" top: "r" }
layer { name: "x" type: "Eltwise" bottom: "r" bottom: "b" top: "s" }
layer { name: "loss" type: "EuclideanLoss" bottom: "s" bottom: "data" top: "loss" }''')
    net = caffe.Net(path, caffe.TRAIN)
    net.forward(data=np.ones((2, 3)), b=np.ones((2, 3)))
    net.backward()
    assert [name for name in net._layer_names if 'split' not in name] == ['in', 'x', 'x', 'loss']


def test_prelu_without_bottom(tmp_path):
    path = write(tmp_path / 'net.prototxt', 'layer { name: "p" type: "PReLU" top: "a" }')
    one_line(error_of(caffe.Net, path, caffe.TEST), path, "layer 'p' (type PReLU)",
             'expects 1 bottom blob(s), got 0')


def test_python_layer_with_an_empty_module(tmp_path):
    path = write(tmp_path / 'net.prototxt', 'layer { name: "py" type: "Python" top: "a" '
                 'python_param { module: "" layer: "L" } }')
    one_line(error_of(caffe.Net, path, caffe.TEST), path, "layer 'py'", "module ''")


def test_nan_in_a_filler(tmp_path):
    path = write(tmp_path / 'net.prototxt', NET % ('', 'dim: 2 dim: 3') + '''
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param {
  num_output: 2 weight_filler { type: "gaussian" std: nan } } }''')
    one_line(error_of(caffe.Net, path, caffe.TEST), path, "layer 'ip'", "filler 'gaussian'",
             'std must be finite')


def test_a_2mb_token_is_not_echoed(tmp_path):
    path = write(tmp_path / 'net.prototxt', 'layer { name: "x" bottom: ' + '9' * (2 << 20) + ' }')
    message = one_line(error_of(caffe.Net, path, caffe.TEST), '%s:1:' % path)
    assert '(2097152 characters)' in message


def test_lr_policy_at_an_absurd_iteration(tmp_path):
    from caffe_syncbn.training.lr_policy import LearningRatePolicy
    policy = LearningRatePolicy(caffe_pb2.SolverParameter(
        base_lr=0.1, lr_policy='poly', power=0.5, max_iter=10), source='s.prototxt')
    assert policy.rate(10) == 0
    one_line(error_of(policy.rate, 11), 's.prototxt', "'poly'", 'iteration 11')
    step = LearningRatePolicy(caffe_pb2.SolverParameter(
        base_lr=0.1, lr_policy='step', gamma=2, stepsize=1), source='s.prototxt')
    one_line(error_of(step.rate, 5000), 's.prototxt', "'step'", 'iteration 5000')


# ---- snapshots ------------------------------------------------------------------------------
SOLVER = '''net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" max_iter: 1
snapshot_prefix: "snap/run" snapshot_format: %s
'''
SMALL_NET = NET % ('', 'dim: 2 dim: 3') + '''layer { name: "ip" type: "InnerProduct" bottom:
  "data" top: "ip" inner_product_param { num_output: 400 } }'''


def snapshot_solver(folder, fmt='BINARYPROTO'):
    write(folder / 'net.prototxt', SMALL_NET)
    write(folder / 'solver.prototxt', SOLVER % fmt)
    (folder / 'snap').mkdir(exist_ok=True)
    return get_solver('solver.prototxt')


@pytest.mark.parametrize('fmt', ['BINARYPROTO', 'HDF5'])
def test_failed_solverstate_write_names_the_solverstate(tmp_path, monkeypatch, fmt):
    monkeypatch.chdir(tmp_path)
    solver = snapshot_solver(tmp_path, fmt)
    suffix = '.h5' if fmt == 'HDF5' else ''
    (tmp_path / 'snap' / ('run_iter_0.solverstate' + suffix)).mkdir()    # cannot be replaced
    message = one_line(error_of(solver.snapshot), 'snap/run_iter_0.solverstate' + suffix)
    assert 'caffemodel' not in message
    assert (tmp_path / 'snap' / ('run_iter_0.caffemodel' + suffix)).is_file()


@pytest.mark.parametrize('fmt', ['BINARYPROTO', 'HDF5'])
def test_full_disk_is_one_line_naming_the_file(tmp_path, monkeypatch, capfd, fmt):
    """Writes go to /dev/full, which fails them with ENOSPC as a full disk does."""
    import tempfile
    monkeypatch.chdir(tmp_path)
    solver = snapshot_solver(tmp_path, fmt)
    real_mkstemp = tempfile.mkstemp

    def mkstemp_on_a_full_disk(**kwargs):
        fd, path = real_mkstemp(**kwargs)
        os.close(fd)
        os.remove(path)
        os.symlink('/dev/full', path)
        return os.open(path, os.O_WRONLY), path
    monkeypatch.setattr(tempfile, 'mkstemp', mkstemp_on_a_full_disk)
    suffix = '.caffemodel.h5' if fmt == 'HDF5' else '.caffemodel'
    one_line(error_of(solver.snapshot), 'cannot write snap/run_iter_0' + suffix,
             'No space left on device')
    assert 'HDF5-DIAG' not in capfd.readouterr().err
    solver.close()                          # which removes the prefix's lock file
    assert sorted(os.listdir(tmp_path / 'snap')) == []


def test_file_size_limit_on_hdf5_snapshot_is_one_line(tmp_path):
    """The issue's raw RuntimeError traceback, in a child process under RLIMIT_FSIZE."""
    write(tmp_path / 'net.prototxt', SMALL_NET)
    write(tmp_path / 'solver.prototxt', SOLVER % 'HDF5')
    (tmp_path / 'snap').mkdir()
    script = ('import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000)); '
              'from caffe_syncbn.cli.common import run_main; '
              'from caffe_syncbn.pycaffe.caffe import get_solver; '
              'run_main(lambda: get_solver("solver.prototxt").snapshot() and 0)')
    done = watchdog.run([sys.executable, '-c', script], cwd=tmp_path, capture_output=True,
                        text=True, limit=120,             # the solver's INFO lines left out
                        env=dict(os.environ, PYTHONPATH=str(ROOT), GLOG_minloglevel='1'))
    assert done.returncode == 1, done.stderr
    assert 'Traceback' not in done.stderr and 'HDF5-DIAG' not in done.stderr, done.stderr
    one_line(done.stderr.strip(), 'error: cannot write snap/run_iter_0.caffemodel.h5',
             'File too large')


def test_temporary_files_of_a_killed_snapshot_are_removed(tmp_path, monkeypatch):
    """A process killed (SIGKILL) while writing leaves its temporary file; the next
    snapshot of the same prefix removes it, and leaves complete snapshots, other
    prefixes and the files of live writers alone."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'snap').mkdir()
    script = ('import os, signal; from caffe_syncbn.formats.atomic import atomic_write\n'
              'with atomic_write("snap/run_iter_7.caffemodel") as f:\n'
              '    f.write(b"x" * 1000); f.flush(); os.kill(os.getpid(), signal.SIGKILL)\n')
    child = subprocess.Popen([sys.executable, '-c', script], cwd=tmp_path,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert watchdog.wait(child, limit=60) == -signal.SIGKILL
    (left,) = [p.name for p in (tmp_path / 'snap').iterdir()]
    assert left.startswith('.run_iter_7.caffemodel.%d.' % child.pid) and left.endswith('.tmp')
    kept = ['run_iter_5.caffemodel', '.other_iter_1.caffemodel.1.abcdefgh.tmp',
            '.run_iter_9.caffemodel.%d.abcdefgh.tmp' % os.getpid()]
    for name in kept + ['.run_iter_6.solverstate.h5.a1b2c3d4.tmp']:     # an older, pid-less one
        write(tmp_path / 'snap' / name, 'x')
    solver = snapshot_solver(tmp_path)
    solver.snapshot()
    solver.close()                          # which removes the prefix's lock file
    assert sorted(p.name for p in (tmp_path / 'snap').iterdir()) == sorted(
        kept + ['run_iter_0.caffemodel', 'run_iter_0.solverstate'])
    assert remove_stale_temporaries('snap/run_iter_') == []


def test_atomic_write_failure_is_a_caffe_error_naming_the_target(tmp_path):
    target = tmp_path / 'missing_folder' / 'x.caffemodel'
    message = error_of(lambda: atomic_write(target).__enter__())
    one_line(message, target, 'No such file or directory')


# ---- the tools: one line, or a traceback with --debug ----------------------------------------
def test_tools_print_one_line_and_a_traceback_with_debug(tmp_path):
    require(GOLDEN / 'net_lenet.caffemodel')
    bad = write(tmp_path / 'bad.prototxt', 'layer { name: "p" type: "PReLU" top: "a" }')
    command = [sys.executable, str(ROOT / 'tools' / 'test_net.py'), '--model', bad,
               '--weights', str(GOLDEN / 'net_lenet.caffemodel'), '--iterations', '1']
    done = watchdog.run(command, capture_output=True, text=True, limit=120)
    assert done.returncode == 1 and 'Traceback' not in done.stderr, done.stderr
    one_line(done.stderr.strip().splitlines()[-1], 'error: %s' % bad, "layer 'p'")
    done = watchdog.run(command + ['--debug'], capture_output=True, text=True, limit=120)
    assert done.returncode == 1 and 'Traceback (most recent call last)' in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith('error: %s' % bad)
