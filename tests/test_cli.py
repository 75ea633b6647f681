"""The caffe-syncbn command: Caffe's subcommands, its flags in every gflags spelling, errors
in this command's spelling, and the upgrade, convert and draw subcommands."""
import logging
import os
import sys

import numpy as np
import pytest
from helpers import watchdog
from helpers.emulated_gpu import emulated_gpu

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.cli import commands, main
from caffe_syncbn.cli.commands import parse
from caffe_syncbn.errors import CaffeError

from helpers.paths import GOLDEN, ROOT, require

LIMIT = 120          # seconds a command may take on an idle machine (tests/helpers/watchdog.py)


def run_cli(*args, cwd=None):
    """``python -m caffe_syncbn ARGS`` as a user runs it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return watchdog.run([sys.executable, '-m', 'caffe_syncbn'] + [str(a) for a in args],
                        cwd=cwd, env=env, capture_output=True, text=True, limit=LIMIT)


def one_error_line(result):
    assert result.returncode == 1, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith('error: '), result.stderr
    return lines[0]


# ---- flags --------------------------------------------------------------------------------
TRAIN_SPELLINGS = [
    ['-solver', 's.prototxt', '-gpu', '0,1', '-sync_bn', '-sigint_effect', 'snapshot',
     '-stage', 'a,b', '-level', '2', '-weights', 'w1,w2'],
    ['-solver=s.prototxt', '-gpu=0,1', '-sync_bn=true', '-sigint_effect=snapshot',
     '-stage=a', '-stage=b', '-level=2', '-weights=w1,w2'],
    ['--solver', 's.prototxt', '--gpu', '0,1', '--sync_bn', '--sigint_effect', 'snapshot',
     '--stage', 'a,b', '--level', '2', '--weights', 'w1,w2'],
    ['--solver=s.prototxt', '--gpus=0,1', '--sync-bn', '--sigint-effect=snapshot',
     '--stage', 'a', '--stage=b', '--level=2', '--weights', 'w1,w2'],          # the old tool's
]


@pytest.mark.parametrize('argv', TRAIN_SPELLINGS)
def test_every_gflags_spelling_reads_the_same(argv):
    args = parse('train', argv)
    assert (args.solver, args.gpu, args.sync_bn, args.sigint_effect, args.stage, args.level,
            args.weights) == ('s.prototxt', [0, 1], True, 'snapshot', ['a', 'b'], 2, 'w1,w2')
    assert (args.cpu_devices, args.sighup_effect, args.nan_effect) == (None, 'snapshot', 'none')


def test_switches_flags_with_values_and_old_spellings():
    for argv, on in ((['-nosync_bn'], False), (['-sync_bn=false'], False),
                     (['-sync_bn', '-nosync_bn'], False), (['-nosync_bn', '--sync-bn'], True),
                     (['--sync_bn=1'], True), ([], False)):
        assert parse('train', ['-solver', 's'] + argv).sync_bn is on, argv
    assert parse('train', ['-solver', 's', '--cpu-devices', '4']).cpu_devices == 4
    assert parse('train', ['-solver', 's', '-gpu', 'all']).gpu == 'all'
    args = parse('test', ['-model=m', '--weights', 'a,b', '-iterations=3', '--cpu', '-level',
                          '-1'])
    assert (args.model, args.weights, args.iterations, args.cpu, args.level) == \
        ('m', 'a,b', 3, True, -1)
    args = parse('time', ['--model', 'm', '--batch=2', '-phase', 'TEST', '--gpu', '1'])
    assert (args.batch, args.phase, args.gpu, args.iterations) == (2, 'TEST', [1], 50)


@pytest.mark.parametrize('command, argv, words', [
    ('train', ['-solver', 's', '-cpu_devices', '0'], ['-cpu_devices', '>= 1', "'0'"]),
    ('train', ['-solver', 's', '--cpu-devices=-2'], ['-cpu_devices', "'-2'"]),
    ('train', ['-solver', 's', '-cpu_devices', 'four'], ['-cpu_devices', "'four'"]),
    ('train', ['-solver', 's', '-gpu', '0,,1'], ['-gpu', 'GPU ids', "'0,,1'"]),
    ('train', ['-solver', 's', '-gpu', 'cpu:4'], ['-gpu', "'cpu:4'"]),
    ('train', ['-solver', 's', '-gpu', '0', '-cpu_devices', '2'], ['-cpu_devices', '-gpu']),
    ('train', ['-solver', 's', '-sigint_effect', 'bogus'], ['-sigint_effect', "'bogus'"]),
    ('train', ['-solver', 's', '-nan_effect', 'halt'], ['-nan_effect', "'halt'"]),
    ('train', [], ['required', '-solver']),
    ('train', ['-solver'], ['-solver needs a value']),
    ('train', ['-solver', 's', '-sync_bn=maybe'], ['-sync_bn=maybe', 'true or false']),
    ('train', ['-solver', 's', '-nosolver'], ['-nosolver', '"no" prefix']),
    ('train', ['-solver', 's', '-model', 'm'], ['unknown flag -model', '-solver', '-weights']),
    ('test', ['-modle', 'm', '-weights', 'w'], ['unknown flag -modle', 'did you mean -model?']),
    ('test', ['-model', 'm', '-weights', 'w', '-iterations', '0'], ['-iterations', "'0'"]),
    ('time', ['-model', 'm', '-phase', 'VAL'], ['-phase', "'VAL'"]),
])
def test_a_bad_flag_is_one_error_naming_it(command, argv, words):
    with pytest.raises(CaffeError) as info:
        parse(command, argv)
    message = str(info.value)
    assert '\n' not in message
    for word in words:
        assert word in message, (word, message)


@pytest.fixture
def logger_kept():
    """main() sets up the package's logger as a command does; give the next tests theirs."""
    logger = logging.getLogger('caffe_syncbn')
    state = logger.handlers[:], logger.propagate, logger.level
    yield
    logger.handlers[:], logger.propagate, logger.level = state


def test_flags_may_come_before_the_command(tmp_path, logger_kept):
    with pytest.raises(CaffeError, match=r'^-solver .*nope\.prototxt: no such file'):
        main(['-solver', str(tmp_path / 'nope.prototxt'), 'train'])
    with pytest.raises(CaffeError, match=r'^-model .*: a folder, not a file'):
        main(['test', '-model', str(tmp_path), '-weights', 'w.caffemodel'])


def test_solver_mode_gpu_without_a_gpu_trains_on_the_cpu(tmp_path, logger_kept):
    from caffe_syncbn.cli.devices import train_devices
    args = parse('train', ['-solver', 'solver.prototxt'])
    param = caffe_pb2.SolverParameter(solver_mode=caffe_pb2.SolverParameter.GPU, device_id=1)
    if caffe.backend.gpu_count() == 0:
        assert train_devices(args, param) == 'cpu:1'
    assert train_devices(args, caffe_pb2.SolverParameter(solver_mode=0)) == 'cpu:1'
    assert train_devices(parse('train', ['-solver', 's', '-cpu_devices', '3']), param) == 'cpu:3'


@pytest.mark.parametrize('flags, tf32', [([], None), (['-tf32'], '1')])
def test_tf32_on_a_gpu_is_asked_for_by_the_flag(monkeypatch, flags, tf32):
    from caffe_syncbn.cli.devices import select_device, train_devices
    emulated_gpu(monkeypatch)
    monkeypatch.delenv('CUPY_TF32', raising=False)
    assert train_devices(parse('train', ['-solver', 's', '-gpu', '0,0'] + flags)) == 'gpu:0,0'
    assert os.environ.get('CUPY_TF32') == tf32
    monkeypatch.delenv('CUPY_TF32', raising=False)
    try:
        select_device(parse('time', ['-model', 'm', '-gpu', '1'] + flags))
    finally:
        caffe.set_mode_cpu()
    assert os.environ.get('CUPY_TF32') == tf32


def test_cli_errors_speak_the_cli(tmp_path):
    solver = tmp_path / 'solver.prototxt'
    solver.write_text('net: "net.prototxt"\n')
    if caffe.backend.gpu_count() == 0:
        line = one_error_line(run_cli('train', '-solver', solver, '-gpu', '0'))
        assert '-gpu 0: no GPU is available' in line and '-cpu_devices N' in line, line
        assert 'cpu:' not in line, line                   # not the Python API's syntax
    line = one_error_line(run_cli('train', '-solver', solver, '--cpu-devices', '0'))
    assert '-cpu_devices' in line and "'0'" in line
    line = one_error_line(run_cli('trian', '-solver', solver))
    assert "unknown command 'trian'; did you mean train?" in line
    line = one_error_line(run_cli('-solver', solver))
    assert 'no command given before or after -solver; the commands are train,' in line, line
    solver.write_text('net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 2\n')
    (tmp_path / 'net.prototxt').write_text(
        'layer { name: "d" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }'
        'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
        'inner_product_param { num_output: 2 } }'
        'layer { name: "l" type: "Reduction" bottom: "y" top: "loss" loss_weight: 1 }')
    result = run_cli('train', '-solver', solver, cwd=tmp_path)   # after the start-up log
    assert result.returncode == 1 and result.stderr.splitlines()[-1].startswith(
        "error: caffe-syncbn train: the train net has Input blobs ('x'), and a command line has "
        'nothing to fill them with; give the net a data layer'), result.stderr
    line = one_error_line(run_cli('-log_file', tmp_path, 'train', '-solver', solver))
    assert line == 'error: -log_file %s: Is a directory' % tmp_path, line


def test_usage_device_query_and_the_console_script():
    result = run_cli()
    assert result.returncode == 1
    for command in ('train', 'test', 'time', 'device_query', 'convert', 'draw', 'upgrade'):
        assert '\n  %s ' % command in result.stderr, result.stderr
    assert run_cli('-help').returncode == 0
    result = run_cli('device_query')
    assert result.returncode == 0, result.stderr
    assert 'CPU: %d cores' % os.cpu_count() in result.stderr
    assert 'GPUs: %d' % caffe.backend.gpu_count() in result.stderr
    quiet = watchdog.run([sys.executable, '-m', 'caffe_syncbn', 'device_query'], text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), GLOG_minloglevel='1'),
                         capture_output=True, limit=LIMIT)
    assert quiet.returncode == 0 and quiet.stderr == '', quiet.stderr     # glog's variable
    # pip installs the command: setup.py declares it, and its target runs main
    from distutils.core import run_setup

    import setuptools  # noqa: F401  (first, so that distutils is setuptools' own)
    cwd = os.getcwd()
    try:
        dist = run_setup(str(ROOT / 'setup.py'), stop_after='init')
    finally:
        os.chdir(cwd)
    assert dist.entry_points['console_scripts'] == ['caffe-syncbn = caffe_syncbn.cli:console_main']


# ---- upgrade -------------------------------------------------------------------------------
def test_upgrade_v1_prototxt_and_caffemodel(tmp_path):
    """Caffe's golden V1 files, upgraded, build and load into the net Caffe ran, with
    Caffe's outputs."""
    case = 'format_v1_caffemodel'
    require(GOLDEN / (case + '.npz'))
    for suffix in ('.v1.prototxt', '.v1.caffemodel'):
        result = run_cli('upgrade', GOLDEN / (case + suffix), tmp_path / ('new' + suffix[3:]))
        assert result.returncode == 0, result.stderr
    text = (tmp_path / 'new.prototxt').read_text()
    assert 'layers {' not in text and 'input_dim' not in text and 'type: "Input"' in text
    from caffe_syncbn.formats.caffemodel import read_net_param
    stored = read_net_param(str(tmp_path / 'new.caffemodel'))
    assert len(stored.layers) == 0 and len(stored.layer) > 0
    ref = np.load(GOLDEN / (case + '.npz'))
    net = caffe.Net(str(tmp_path / 'new.prototxt'), caffe.TEST,
                    weights=str(tmp_path / 'new.caffemodel'))
    inputs = {name: ref['input/' + name] for name in net.inputs if 'input/' + name in ref}
    assert inputs, sorted(ref.keys())
    net.forward(**inputs)
    for name in ('conv1', 'pool1', 'norm1', 'ip1', 'prob'):
        np.testing.assert_allclose(net.blobs[name].data, ref['data/' + name], rtol=1e-5,
                                   atol=1e-6, err_msg=name)


def test_upgrade_solver_and_files_already_current(tmp_path):
    old = tmp_path / 'old_solver.prototxt'
    old.write_text('net: "n.prototxt"\nbase_lr: 0.01\nsolver_type: ADAM\n')
    result = run_cli('upgrade', old, tmp_path / 'solver.prototxt')
    assert result.returncode == 0, result.stderr
    from caffe_syncbn.netparam.prototxt import read_prototxt
    param = read_prototxt(str(tmp_path / 'solver.prototxt'), caffe_pb2.SolverParameter())
    assert param.type == 'Adam' and not param.HasField('solver_type') and param.base_lr == np.float32(0.01)
    result = run_cli('upgrade', tmp_path / 'solver.prototxt', tmp_path / 'again.prototxt')
    assert 'already in the current format' in result.stderr
    assert (tmp_path / 'again.prototxt').read_text() == (tmp_path / 'solver.prototxt').read_text()


@pytest.mark.parametrize('content, words', [
    (b'\x89HDF\r\n\x1a\n' + bytes(64), ['HDF5', 'nothing to upgrade']),
    (b'layer { name: "a" type: "Input" \n bogus: 1 }\n', ['in.file:2', 'NetParameter']),
    (b'base_lr: 0.1\nmax_iter: x\n', ['in.file:2', 'SolverParameter']),
    (b'\x08\x96\x01\xff\xfe\x00', ['in.file', 'truncated or corrupt']),
    (b'', ['in.file is empty']),
])
def test_upgrade_bad_input_is_one_line(tmp_path, content, words):
    (tmp_path / 'in.file').write_bytes(content)
    line = one_error_line(run_cli('upgrade', tmp_path / 'in.file', tmp_path / 'out'))
    for word in words:
        assert word in line, (word, line)
    assert not (tmp_path / 'out').exists()


# ---- convert and draw ------------------------------------------------------------------------
def test_convert_takes_gflags_spellings(tmp_path):
    net = tmp_path / 'net.prototxt'
    net.write_text('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 '
                   'dim: 2 dim: 3 dim: 3 } } }\n'
                   'layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x" }\n'
                   'layer { name: "sc" type: "Scale" bottom: "x" top: "x" '
                   'scale_param { bias_term: true } }\n')
    result = run_cli('convert', 'to-syncbn', '-model=%s' % net, '-output', tmp_path / 'out')
    assert result.returncode == 0, result.stderr
    assert 'type: "SyncBN"' in (tmp_path / 'out.prototxt').read_text()
    line = one_error_line(run_cli('convert', 'to-syncbn', '-modle', net, '-output', 'x'))
    assert 'did you mean --model?' in line


def test_draw_writes_the_diagram(tmp_path):
    net = tmp_path / 'net.prototxt'
    net.write_text('name: "n"\nlayer { name: "in" type: "Input" top: "x" input_param { shape '
                   '{ dim: 1 dim: 2 } } }\nlayer { name: "ip" type: "InnerProduct" bottom: "x" '
                   'top: "y" inner_product_param { num_output: 3 } }\n'
                   'layer { name: "train_only" type: "ReLU" bottom: "y" top: "y" '
                   'include { phase: TRAIN } }\n')
    result = run_cli('draw', net, tmp_path / 'net.dot', '-rankdir=TB', '--phase', 'TEST')
    assert result.returncode == 0, result.stderr
    dot = (tmp_path / 'net.dot').read_text()         # Graphviz source: no Graphviz needed
    assert 'rankdir="TB";' in dot and 'InnerProduct' in dot and 'train_only' not in dot, dot
    result = run_cli('draw', net, tmp_path / 'all.dot')
    assert result.returncode == 0, result.stderr
    dot = (tmp_path / 'all.dot').read_text()
    assert 'train_only' in dot and 'rankdir="LR";' in dot, dot
    result = run_cli('draw', net, tmp_path / 'net.png')      # rendered by graphviz-pure
    assert result.returncode == 0, result.stderr
    assert (tmp_path / 'net.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_signal_effect_none_ignores_the_signal_as_caffe_does():
    """An effect of none (an option of -sigint_effect and -sighup_effect) catches the
    signal and keeps training; other effects become the loop's next request."""
    import signal

    from caffe_syncbn.cli.commands import SignalRequests
    before = signal.getsignal(signal.SIGINT)     # SIG_IGN where a shell started the suite with &
    requests = SignalRequests('none', 'none', 'none')
    try:
        os.kill(os.getpid(), signal.SIGHUP)          # would end this process uncaught
        os.kill(os.getpid(), signal.SIGINT)          # would raise KeyboardInterrupt
        assert requests.take() is None
    finally:
        requests.close()
    requests = SignalRequests('stop', 'snapshot', 'snapshot')
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        assert requests.take() == 'snapshot' and requests.take() is None
        os.kill(os.getpid(), signal.SIGINT)
        assert requests.take() == 'stop'
    finally:
        requests.close()
    assert signal.getsignal(signal.SIGINT) is before


def test_the_command_line_loads_onnx_only_for_an_export(tmp_path):
    """`caffe-syncbn time` and the other commands run without the onnx package in the
    process (14 MiB of a small net's peak); to-onnx loads it, and without it says how to
    get it in one line."""
    script = ('import sys; import caffe_syncbn.cli, caffe_syncbn.analysis.timing; '
              'print("onnx" in sys.modules)')
    loaded = watchdog.run([sys.executable, '-c', script], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.split()
    assert loaded == ['False']
    script = ('import sys; sys.modules["onnx"] = None; '
              'from caffe_syncbn.export import to_onnx; to_onnx(sys.argv[1])')
    failed = watchdog.run([sys.executable, '-c', script, str(tmp_path / 'x.prototxt')],
                          cwd=ROOT, capture_output=True, text=True)
    assert failed.returncode != 0
    assert failed.stderr.strip().splitlines()[-1] == (
        "caffe_syncbn.errors.CaffeError: ONNX export needs the onnx package: "
        "pip install 'caffe-syncbn[onnx]'")


@pytest.mark.parametrize('field, flag, plan', [(None, None, 'auto'), ('share', None, 'share'),
                                               ('share', 'off', 'off'), (None, 'recompute',
                                                                         'recompute')])
def test_train_takes_the_plan_of_the_flag_then_the_solver_file_then_auto(
        tmp_path, monkeypatch, logger_kept, field, flag, plan):
    solver = caffe_pb2.SolverParameter(net='net.prototxt', max_iter=1)
    if field:
        solver.memory_plan = field
    path = tmp_path / 'solver.prototxt'
    path.write_text(str(solver))
    asked = []

    def get_solver(*args, **kwargs):
        asked.append(kwargs['memory_plan'])
        raise CaffeError('stop here')
    monkeypatch.setattr(commands, 'get_solver', get_solver)
    with pytest.raises(CaffeError, match='stop here'):
        main(['train', '-solver', str(path)] + (['-memory_plan', flag] if flag else []))
    assert asked == [plan]
