"""What a new user meets in the first hour: one ``get_solver`` that trains from Input blobs
set by hand, as pycaffe does, against real Caffe's trajectories; errors that name the file
to fix (the net file and its line, the kind of a file given in the wrong place, the net
file before the snapshot prefix); one warning for a caffemodel of another net; pycaffe's
solver log on stderr; ``-version``."""
import logging
import os
import re
import sys

import numpy as np
import pytest
from helpers import watchdog

import caffe_syncbn as caffe
from caffe_syncbn.cli import commands, main
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.netparam.solver_param import load_solver_param
from caffe_syncbn.pycaffe import caffe as pycaffe

from helpers.paths import GOLDEN, ROOT, require

TIMEOUT = 120
RTOL = 1e-5
GLOG_LINE = re.compile(r'^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] ')


@pytest.fixture
def logger_kept():
    """main() sets up the package's logger as a command does; give the next tests theirs."""
    logger = logging.getLogger('caffe_syncbn')
    state = logger.handlers[:], logger.propagate, logger.level
    yield
    logger.handlers[:], logger.propagate, logger.level = state


def error_of(call, *args, **kwargs):
    with pytest.raises(CaffeError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert '\n' not in message, message
    return message


# ---- pycaffe's training loop: Input blobs set by hand -------------------------------------
@pytest.mark.parametrize('devices', [None, 'cpu:1'])
@pytest.mark.parametrize('name', ['solver_sgd_fixed', 'solver_nesterov'])
def test_input_blobs_set_by_hand_train_as_in_real_caffe(name, devices, tmp_path, monkeypatch):
    """pycaffe's loop (``solver.net.blobs[b].data[...] = x; solver.step(1)``) through the
    package's own ``get_solver``, on one device, gives real Caffe's losses and params for
    12 iterations (the golden trajectories were recorded from that very loop)."""
    require(GOLDEN / (name + '.npz'))
    assert caffe.get_solver is pycaffe.get_solver     # install_as_caffe()'s is the same one
    monkeypatch.chdir(GOLDEN)
    ref = np.load(GOLDEN / (name + '.npz'))
    param = load_solver_param(name + '.solver.prototxt')
    param.snapshot_prefix = str(tmp_path / name)      # never write into the shared folder
    with caffe.get_solver(param, **({} if devices is None else {'devices': devices})) as solver:
        solver.net.copy_from(name + '.caffemodel')
        for k in range(1, 13):
            for blob in ('data', 'label'):
                solver.net.blobs[blob].data[...] = ref['iter_data/%d/%s' % (k, blob)]
            solver.step(1)
            np.testing.assert_allclose(solver.smoothed_loss, ref['iter_loss/%d' % k], rtol=RTOL,
                                       err_msg='loss of iteration %d' % k)
            head = 'iter_param/%d/' % k
            for key in (key for key in ref.files if key.startswith(head)):
                layer, index = key[len(head):].rsplit('/', 1)
                expected = ref[key].astype(np.float64)
                np.testing.assert_allclose(solver.net.params[layer][int(index)].data, expected,
                                           rtol=RTOL, atol=RTOL * np.abs(expected).max(initial=0),
                                           err_msg=key)


INPUT_NET = '''name: "tiny"
layer { name: "input" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''


DUMMY_NET = INPUT_NET.replace('type: "Input"', 'type: "DummyData"').replace(
    'input_param', 'dummy_data_param')


def write_solver(folder, net_text, extra=''):
    (folder / 'net.prototxt').write_text(net_text)
    (folder / 'solver.prototxt').write_text(
        'net: "%s"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 4\nrandom_seed: 1\n'
        'snapshot_after_train: false\n%s' % (folder / 'net.prototxt', extra))
    return str(folder / 'solver.prototxt')


def test_several_devices_ask_for_a_data_source(tmp_path):
    """Blobs set by hand feed one device: with two, one line says what to give instead."""
    with caffe.get_solver(write_solver(tmp_path, INPUT_NET), devices='cpu:2') as solver:
        solver.net.blobs['data'].data[...] = 1
        message = error_of(solver.step, 1)
    assert message.startswith("Input layer 'input' has no data for 2 replicas: blobs set by "
                              'hand feed a single device only'), message
    assert "solver.set_data_source(lambda: {'data': ..., 'label': ...})" in message, message


# ---- a file of the wrong kind ----------------------------------------------------------------
@pytest.fixture
def snapshots(tmp_path, monkeypatch):
    """A net and a solver prototxt, and a snapshot of both kinds, in tmp_path."""
    monkeypatch.chdir(tmp_path)
    solver_path = write_solver(tmp_path, DUMMY_NET, 'snapshot_prefix: "snap"\n')
    files = {'net': 'net.prototxt', 'solver': 'solver.prototxt'}
    for fmt, suffix in ((caffe.caffe_pb2.SolverParameter.BINARYPROTO, ''),
                        (caffe.caffe_pb2.SolverParameter.HDF5, '.h5')):
        param = load_solver_param(solver_path)
        param.snapshot_format = fmt
        solver = caffe.get_solver(param)
        files['caffemodel' + suffix], files['solverstate' + suffix] = solver.snapshot()
    return files


WEIGHTS_GIVEN_A_STATE = 'is a solver state, not weights (use train -snapshot to resume from it; '
STATE_GIVEN_WEIGHTS = 'is a caffemodel (weights), not a solver state (use -weights to start from it'


@pytest.mark.parametrize('given, said', [
    ('net', 'net.prototxt is a text prototxt (a net definition), not weights (a binary '
            '.caffemodel or a .caffemodel.h5)'),
    ('solver', 'solver.prototxt is a text prototxt (a solver definition), not weights'),
    ('solverstate', 'snap_iter_0.solverstate ' + WEIGHTS_GIVEN_A_STATE),
    ('solverstate.h5', 'snap_iter_0.solverstate.h5 ' + WEIGHTS_GIVEN_A_STATE),
])
def test_weights_of_the_wrong_kind_say_what_they_are(snapshots, given, said, logger_kept):
    path = snapshots[given]
    assert error_of(main, ['train', '-solver', 'solver.prototxt', '-weights', path]) \
        .startswith(said)
    assert error_of(main, ['test', '-model', 'net.prototxt', '-weights', path]).startswith(said)
    assert error_of(caffe.Net, 'net.prototxt', caffe.TEST, weights=path).startswith(said)
    assert error_of(caffe.Net('net.prototxt', caffe.TEST).copy_from, path).startswith(said)


@pytest.mark.parametrize('given, said', [
    ('caffemodel', 'snap_iter_0.caffemodel ' + STATE_GIVEN_WEIGHTS),
    ('caffemodel.h5', 'snap_iter_0.caffemodel.h5 ' + STATE_GIVEN_WEIGHTS),
    ('net', 'net.prototxt is a text prototxt (a net definition), not a solver state (a '
            '.solverstate or a .solverstate.h5)'),
])
def test_a_snapshot_of_the_wrong_kind_says_what_it_is(snapshots, given, said, logger_kept):
    path = snapshots[given]
    assert error_of(main, ['train', '-solver', 'solver.prototxt', '-snapshot', path]) \
        .startswith(said)
    with caffe.get_solver('solver.prototxt') as solver:
        assert error_of(solver.restore, path).startswith(said)


# ---- errors in the net file -----------------------------------------------------------------
NET_WITH_PHASES = '''name: "phases"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  include { phase: TRAIN }
  dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
layer { name: "data" type: "DummyData" top: "data" top: "label"
  include { phase: TEST }
  dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 } data_filler { type: "constant" }
                     data_filler { type: "constant" } data_filler { type: "constant" } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLos" bottom: "ip" bottom: "label" top: "loss" }
'''


def test_an_error_in_the_net_names_the_net_file_and_its_line(tmp_path, monkeypatch,
                                                             logger_kept):
    """Under a solver, the net file and the line of the layer (of the net's phase, where
    a name repeats), not the solver file; so for Net(path) and `train -solver`."""
    monkeypatch.chdir(tmp_path)
    solver = write_solver(tmp_path, NET_WITH_PHASES)
    net = str(tmp_path / 'net.prototxt')
    typo = "%s:11: layer 'loss': unknown layer type 'SoftmaxWithLos'; did you mean " % net
    assert error_of(caffe.get_solver, solver).startswith(typo)
    assert error_of(caffe.Net, net, caffe.TRAIN).startswith(typo)
    with pytest.raises(CaffeError, match='^' + re.escape(typo)):
        main(['train', '-solver', solver])
    # the TEST net's 'data' (3 fillers for 2 tops), the second layer of that name
    (tmp_path / 'net.prototxt').write_text(NET_WITH_PHASES.replace('SoftmaxWithLos', 'SoftmaxWithLoss'))
    with open(solver, 'a') as f:
        f.write('test_iter: 1\ntest_interval: 10\n')
    message = error_of(caffe.get_solver, solver)
    assert message.startswith("%s:5: layer 'data' (type DummyData): " % net), message
    assert 'solver.prototxt' not in message, message


def test_a_missing_net_file_comes_before_the_snapshot_prefix(tmp_path, monkeypatch):
    """Run from the wrong folder, every relative path misses; the net file's error says
    where to run from."""
    (tmp_path / 'run').mkdir()
    write_solver(tmp_path / 'run', INPUT_NET, 'snapshot: 2\nsnapshot_prefix: "snaps/tiny"\n')
    text = (tmp_path / 'run' / 'solver.prototxt').read_text()
    (tmp_path / 'run' / 'solver.prototxt').write_text(
        text.replace(str(tmp_path / 'run' / 'net.prototxt'), 'net.prototxt'))
    (tmp_path / 'run' / 'snaps').mkdir()
    monkeypatch.chdir(tmp_path)
    message = error_of(caffe.get_solver, 'run/solver.prototxt')
    assert message.startswith("run/solver.prototxt: net file 'net.prototxt' not found"), message
    assert message.endswith('it exists next to the solver file: run from %s' % (tmp_path / 'run'))
    monkeypatch.chdir(tmp_path / 'run')
    caffe.get_solver('solver.prototxt').close()


# ---- a caffemodel of another net ---------------------------------------------------------------
THREE_LAYERS = '''name: "mine"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1" inner_product_param { num_output: 3 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" inner_product_param { num_output: 3 } }
layer { name: "ip3" type: "InnerProduct" bottom: "ip2" top: "ip3" inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip3" bottom: "label" top: "loss" }
'''


def test_a_caffemodel_of_another_net_is_one_warning_with_the_count(tmp_path, logger_kept, capfd):
    """Train and test net both take the file: one warning, naming how many layers fit."""
    solver = write_solver(tmp_path, THREE_LAYERS, 'test_iter: 1\ntest_interval: 2\n')
    other = tmp_path / 'other.caffemodel'
    other_net = THREE_LAYERS.replace('"ip2"', '"fc2"').replace('"ip3"', '"fc3"')
    (tmp_path / 'other.prototxt').write_text(other_net)
    caffe.Net(str(tmp_path / 'other.prototxt'), caffe.TRAIN).save(str(other))
    capfd.readouterr()
    assert main(['train', '-solver', solver, '-weights', str(other)]) == 0
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith('W')]
    assert len(warnings) == 1, warnings
    assert warnings[0].endswith(
        "%s matches only 1 of the 3 layers with params of net 'mine' by name (is it the "
        "caffemodel of another net?); the other 2 keep their initial values: 'ip2', 'ip3'"
        % other), warnings


# ---- the solver's log, the version, the help ----------------------------------------------------
def test_pycaffe_solvers_log_their_iterations_on_stderr(tmp_path):
    """As pycaffe's glog does before InitGoogleLogging: INFO lines on stderr without
    init_log(), in glog's format; GLOG_minloglevel quiets them."""
    solver = write_solver(tmp_path, INPUT_NET, 'display: 1\n')
    script = ('import numpy as np, caffe_syncbn as caffe\n'
              's = caffe.get_solver(%r)\n'
              "s.net.blobs['label'].data[...] = [0, 1, 2, 0]\n"
              's.step(2)\n' % solver)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop('GLOG_minloglevel', None)
    run = watchdog.run([sys.executable, '-c', script], env=env, capture_output=True,
                       text=True, limit=TIMEOUT)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert lines and all(GLOG_LINE.match(line) for line in lines), run.stderr
    said = [GLOG_LINE.sub('', line) for line in lines]
    for k in (0, 1):
        assert any(re.fullmatch(r'Iteration %d, loss = [\d.]+' % k, line) for line in said), said
        assert 'Iteration %d, lr = 0.1' % k in said, said
    assert any(line.startswith('    Train net output #0: loss = ') for line in said), said
    env['GLOG_minloglevel'] = '1'
    quiet = watchdog.run([sys.executable, '-c', script], env=env, capture_output=True,
                         text=True, limit=TIMEOUT)
    assert quiet.returncode == 0 and quiet.stderr == '', quiet.stderr


@pytest.mark.parametrize('argv', [['-version'], ['--version'], ['train', '-solver', 's', '-version']])
def test_version(argv, capsys):
    assert main(argv) == 0
    assert capsys.readouterr().out == 'caffe-syncbn version %s\n' % caffe.__version__


def test_the_memory_plan_help_of_test_and_time_speaks_of_no_solver_file():
    def help_of(command):
        return ' '.join(commands._parser(command).format_help().split())
    for command in ('test', 'time'):
        assert 'solver' not in help_of(command), command
    assert 'auto (the default, unless the solver file sets memory_plan)' in help_of('train')
