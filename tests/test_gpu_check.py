"""`make gpu-check` (tools/gpu_check.py) where there is no GPU: the preflight names the missing
GPU in one line, the CPU half of the training comparison runs through `caffe-syncbn train`,
the report is written into one flat folder, and the exit status says that something was
missing. The loss parser and the comparison are checked on the log of that run, and
benchmarks/efficiency.py against the calculation of docs/training.md. The budget and the
report's files are checked on a driver whose steps are small commands, the compile-kernels
step through a stand-in CuPy, the probe of the cuDNN frontend and of torch's cuDNN through
stand-ins of them, and the resnet50 step's runs and note on the lines train_gpu.py prints."""
import importlib
import math
import re
import sys
import time
import types

import pytest
from helpers import watchdog

from caffe_syncbn.backend import cuda_kernels, gpu_count
from helpers.paths import ROOT

sys.path.insert(0, str(ROOT / 'tools'))
sys.path.insert(0, str(ROOT / 'benchmarks'))

import gpu_check  # noqa: E402
from efficiency import step_on_many  # noqa: E402
from gpu_check_report import probe, verdict  # noqa: E402
from gpu_check_training import ITERATIONS, TOLERANCE, compare_losses, losses  # noqa: E402

MB = 1e6


@pytest.fixture(scope='module')
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('report')
    result = watchdog.run([sys.executable, str(ROOT / 'tools' / 'gpu_check.py'), '--only',
                           'preflight,train-reference', '--out', str(out)],
                          capture_output=True, text=True, limit=300)
    return result, out


def test_the_report_is_written_and_the_reference_trains(cpu_run):
    result, out = cpu_run
    assert sorted(p.name for p in out.iterdir()) == ['report.md', 'steps.log'], \
        result.stdout[-3000:] + result.stderr[-3000:]
    report = (out / 'report.md').read_text()
    for heading in ('# make gpu-check', '## Preflight', '## Steps', '### train-reference'):
        assert re.search('^%s$' % re.escape(heading), report, re.M), report
    rows = re.findall(r'^\| ([\w-]+) \| (\w+) \| \d+ \| ([\w.:-]+) \|', report, re.M)
    assert rows == [('train-reference', 'passed', 'steps.log:1')], report
    assert (out / 'steps.log').read_text().startswith('==== train-reference (limit ')
    assert re.search(r'^\| commit \| \S', report, re.M), report
    assert re.search(r'^`\S*python\S* -m caffe_syncbn train .*-sync_bn -cpu_devices 2`$', report,
                     re.M), report
    assert 'Iteration %d, loss = ' % ITERATIONS in report


@pytest.mark.skipif(gpu_count() > 0, reason='this machine has a GPU: nothing to name missing')
def test_the_missing_gpu_is_one_line_and_fails_the_run(cpu_run):
    result, out = cpu_run
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    report = (out / 'report.md').read_text()
    gpu_lines = [line for line in report.splitlines() if line.startswith('- missing: gpu:')]
    assert len(gpu_lines) == 1, report
    assert 'every GPU step is skipped' in gpu_lines[0]
    assert re.search(r'^\| GPU \| none \|$', report, re.M), report
    assert result.stdout.count('missing: gpu:') == 1, result.stdout


def test_the_loss_parser_reads_a_real_training_log(cpu_run):
    _, out = cpu_run
    text = (out / 'steps.log').read_text()
    parsed = losses(text)
    assert sorted(parsed) == list(range(ITERATIONS + 1))
    # every iteration also prints "Train net output #0: loss = ...": those are not losses here
    assert text.count('loss = ') > len(parsed)
    for iteration, value in re.findall(r'\] Iteration (\d+), loss = (\S+)$', text, re.M):
        assert parsed[int(iteration)] == float(value)
    assert all(math.isfinite(v) and v > 0 for v in parsed.values())


def test_the_comparison_allows_rounding_and_catches_more(cpu_run):
    _, out = cpu_run
    reference = losses((out / 'steps.log').read_text())
    passed, note, rows = compare_losses(reference, dict(reference))
    assert passed and len(rows) == ITERATIONS + 1 and max(r[3] for r in rows) == 0, note
    for iteration, limit in ((0, TOLERANCE['first']), (ITERATIONS, TOLERANCE['any'])):
        for factor, expected in ((0.5, True), (2.0, False)):
            moved = dict(reference)
            moved[iteration] *= 1 + factor * limit
            passed, note, rows = compare_losses(reference, moved)
            assert passed == expected, note
            assert 'at iteration %d' % iteration in note
    short = {k: v for k, v in reference.items() if k != 7}
    passed, note, _ = compare_losses(reference, short)
    assert not passed and 'not 0..%d' % ITERATIONS in note


def test_unknown_step_is_one_error_line(tmp_path):
    result = watchdog.run([sys.executable, str(ROOT / 'tools' / 'gpu_check.py'), '--only',
                           'train-refrence', '--out', str(tmp_path)],
                          capture_output=True, text=True, limit=60)
    assert result.returncode == 2
    assert "unknown step 'train-refrence'" in result.stderr.strip().splitlines()[-1]


def test_efficiency_is_the_calculation_of_docs_training():
    # docs/training.md: T = 1.0 s, 100 batch norms, 260 MB of gradients, buckets of 25 MB,
    # 15 us and 150 GB/s within a node, 40 us and 12 GB/s across two
    one_node, added = step_on_many(1.0, 100, 260 * MB, 15e-6, 150e9, 25 * MB)
    assert one_node == pytest.approx(1.0 + 201 * 15e-6 + 2 * 25 * MB / 150e9, rel=1e-12)
    assert added['unhidden gradients'] == 0
    two_nodes, _ = step_on_many(1.0, 100, 260 * MB, 40e-6, 12e9, 25 * MB)
    assert two_nodes == pytest.approx(1.0 + 201 * 40e-6 + 2 * 25 * MB / 12e9, rel=1e-12)
    assert one_node / two_nodes == pytest.approx(0.99, abs=0.005)
    # a 10 Gb/s link and T = 0.25 s: 430 ms of gradients no longer hide in the backward
    slow, added = step_on_many(0.25, 100, 260 * MB, 40e-6, 1.2e9, 25 * MB)
    assert added['unhidden gradients'] == pytest.approx(2 * 260 * MB / 1.2e9 - 0.65 * 0.25)
    assert 0.40 < 0.25 / slow < 0.50


def test_the_budget_counts_from_the_first_step_and_the_logs_stay_one_file(tmp_path,
                                                                           monkeypatch):
    real = time.monotonic
    waited = [0.0]
    monkeypatch.setattr(time, 'monotonic', lambda: real() + waited[0])

    def slow_preflight(check, commit=None, pspnet=None):
        waited[0] += 600         # a cold machine importing CuPy: longer than the whole budget

    def prints(number):
        return lambda check: [[sys.executable, '-c', 'print("step %d ran")' % number]]
    steps = [gpu_check.Step('step-%d' % n, (1,), 30, 'prints its number', prints(n),
                            [r' ran$'], needs=()) for n in range(9)]
    monkeypatch.setattr(gpu_check, 'STEPS', steps)
    monkeypatch.setattr(gpu_check, 'preflight', slow_preflight)
    monkeypatch.setattr(gpu_check.signal, 'signal', lambda *args: None)
    assert gpu_check.main(['--stage', '1', '--budget', '300', '--out', str(tmp_path)]) == 0
    # nine steps, and still two files: the device tools return at most 8, flat
    assert sorted(p.name for p in tmp_path.iterdir()) == ['report.md', 'steps.log']
    report = (tmp_path / 'report.md').read_text().splitlines()
    assert report[2].startswith('**PASSED**'), report
    log = (tmp_path / 'steps.log').read_text().splitlines()
    rows = [re.match(r'^\| (step-\d) \| (\w+) \| \d+ \| steps\.log:(\d+) \|', line)
            for line in report]
    rows = [row.groups() for row in rows if row]
    assert [(name, status) for name, status, _ in rows] == \
        [('step-%d' % n, 'passed') for n in range(9)]
    for name, _, line in rows:          # each row points at its section of the one log
        assert log[int(line) - 1].startswith('==== %s (limit 30 s) ====' % name)
        assert log[int(line) + 1] == '%s ran' % name.replace('-', ' ')


def test_the_first_line_says_unfinished_until_every_step_is_done():
    check = types.SimpleNamespace(missing=[], planned=['gpu-tests', 'train-gpu'],
                                  results=[{'step': 'gpu-tests', 'status': 'passed'}])
    assert verdict(check).startswith('**UNFINISHED**: 1 of 2 steps done')
    check.results.append({'step': 'train-gpu', 'status': 'skipped'})
    assert verdict(check) == '**FAILED**: skipped: train-gpu.'
    check.missing.append('goldens: /x/golden is missing or empty')
    assert verdict(check).startswith('**FAILED**: the preflight misses goldens; skipped: ')


class StandInModule:
    """cupy.RawModule: records the (source, options) key of each compilation."""
    compiled, asked = [], []

    def __init__(self, code, options):
        self.key = (code, options)

    def compile(self):
        StandInModule.compiled.append(self.key)

    def get_function(self, name):
        StandInModule.asked.append(self.key)
        return name


class StandInDevice:
    def __init__(self, device_id=0):
        self.id = device_id

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_compile_kernels_fills_the_cache_the_layers_read(monkeypatch):
    # CuPy's kernel cache keys on the source text and the options: the step's compilations
    # must be the very ones cuda_kernels makes when a layer first asks for a kernel
    stand_in = types.SimpleNamespace(RawModule=StandInModule,
                                     cuda=types.SimpleNamespace(Device=StandInDevice))
    monkeypatch.setitem(sys.modules, 'cupy', stand_in)
    monkeypatch.setitem(sys.modules, 'gpu_check_kernels', None)
    del sys.modules['gpu_check_kernels']        # imported afresh, on the stand-in
    monkeypatch.setattr(StandInModule, 'compiled', [])
    monkeypatch.setattr(StandInModule, 'asked', [])
    monkeypatch.setattr(cuda_kernels, '_compiled', {})
    lines = []
    importlib.import_module('gpu_check_kernels').compile_all(lines.append)
    stems = cuda_kernels.kernel_stems()
    assert len(StandInModule.compiled) == len(set(StandInModule.compiled)) == len(stems) >= 9
    assert [line.split(':')[0] for line in lines] == stems
    for stem in stems:
        cuda_kernels.kernel(stem, 'any_kernel_f32')
    assert set(StandInModule.asked) == set(StandInModule.compiled)


def stand_in_cuda_stack(monkeypatch, backend_version):
    """CuPy with one device, torch that sees it (its cuDNN 9.1.0), and the cuDNN frontend
    1.32.0 whose libcudnn answers ``backend_version`` (a function)."""
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1, runtimeGetVersion=lambda: 13000,
        driverGetVersion=lambda: 13000,
        getDeviceProperties=lambda index: {'name': b'Stand-in GPU', 'totalGlobalMem': 2 ** 34})
    monkeypatch.setitem(sys.modules, 'cupy', types.SimpleNamespace(
        __version__='14.2.0', cuda=types.SimpleNamespace(runtime=runtime)))
    monkeypatch.setitem(sys.modules, 'torch', types.SimpleNamespace(
        __version__='2.11.0', cuda=types.SimpleNamespace(is_available=lambda: True),
        backends=types.SimpleNamespace(cudnn=types.SimpleNamespace(version=lambda: 90100))))
    monkeypatch.setitem(sys.modules, 'cudnn', types.SimpleNamespace(
        __version__='1.32.0', backend_version=backend_version))


def test_the_probe_finds_the_frontend_its_libcudnn_and_torchs_cudnn(monkeypatch):
    stand_in_cuda_stack(monkeypatch, lambda: 91400)
    found = probe()
    assert found['gpu'].startswith('Stand-in GPU, 16.0 GiB (device 0 of 1; CuPy 14.2.0)')
    assert (found['torch'], found['torch_cudnn']) == ('2.11.0', '9.1.0'), found
    assert (found['cudnn_frontend'], found['cudnn']) == ('1.32.0', '9.14.0'), found


def test_a_frontend_without_libcudnn_is_its_own_missing_thing(monkeypatch):
    def without_libcudnn():       # what the frontend's wheel raises where no libcudnn loads
        raise RuntimeError('Unable to find symbol cudnnGetVersion')
    stand_in_cuda_stack(monkeypatch, without_libcudnn)
    found = probe()
    assert found['cudnn_frontend'] == '1.32.0' and 'cudnn' not in found
    assert found['cudnn_error'] == 'RuntimeError: Unable to find symbol cudnnGetVersion'


def resnet50_check(cudnn_tests=None, output=''):
    results = [{'step': 'cudnn-tests', 'status': cudnn_tests}] if cudnn_tests else []
    return types.SimpleNamespace(results=results, outputs={'resnet50': output})


def engines_and_tf32(commands):
    return [(command[command.index('--engine') + 1], '--tf32' in command)
            for command in commands]


def test_the_resnet50_runs_time_the_cudnn_engine_only_after_its_tests_passed():
    for status in (None, 'failed', 'skipped'):
        commands = gpu_check.resnet50_benchmark(resnet50_check(status))
        assert engines_and_tf32(commands) == [('im2col', False), ('im2col', True)], status
    commands = gpu_check.resnet50_benchmark(resnet50_check('passed'))
    assert engines_and_tf32(commands) == [('cudnn', False), ('cudnn', True), ('im2col', False)]
    assert all(command[command.index('--batch') + 1] == '32' for command in commands)
    stage = [step.name for step in gpu_check.planned(2)]
    assert stage.index('compile-kernels') + 1 == stage.index('cudnn-tests') < \
        stage.index('resnet50')


def resnet50_run(engine, tf32, images_s, torch_images_s=None):
    """The lines of one train_gpu.py run, as it prints them."""
    lines = ['net: ResNet-50 ResNet-50-deploy.prototxt, TRAIN, BatchNorm, input 3x224x224; '
             'global batch 32; median of 3 steps after 1 warm-up; memory plan auto; TF32 %s; '
             'engine %s' % ('on' if tf32 else 'off', engine),
             'devices: gpu:0 (Stand-in GPU)',
             'caffe_syncbn    %7.1f ms/step %7.1f images/s' % (32e3 / images_s, images_s)]
    if torch_images_s:
        lines += ['torch           %7.1f ms/step %7.1f images/s'
                  % (32e3 / torch_images_s, torch_images_s),
                  'ratio (ours / torch): %.2fx (target >= 0.9x)' % (images_s / torch_images_s)]
    else:
        lines += ['torch reference was skipped: torch is not installed']
    return '\n'.join(lines) + '\n'


def test_the_resnet50_note_names_each_ratio_with_its_engine_and_tf32():
    output = (resnet50_run('cudnn', False, 900.0, 1000.0) + resnet50_run('cudnn', True, 1500.0,
              1600.0) + resnet50_run('im2col', False, 300.0, 1000.0))
    passed, note, _ = gpu_check.resnet50_ratios(resnet50_check('passed', output))
    assert passed and note == ('ours / torch: cudnn TF32 off 0.90x, cudnn TF32 on 0.94x, '
                               'im2col TF32 off 0.30x; cudnn / im2col, TF32 off: 3.00x'), note
    output = resnet50_run('im2col', False, 300.0) + resnet50_run('im2col', True, 310.0)
    passed, note, _ = gpu_check.resnet50_ratios(resnet50_check('failed', output))
    assert passed and note == ('no ratios against torch: torch was skipped or a run failed; '
                               'no cudnn runs: cudnn-tests did not pass in this run'), note
