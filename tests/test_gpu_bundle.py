"""What travels to a GPU machine (tools/gpu_bundle.py, `make gpu-bundle`) and the plan of the
two stages of tools/gpu_check.py: a copy of the checkout alone, with its bundle and nothing
beside it, finds the goldens and the corpus (the preflight and the tests' lookup); the
preflight installs only the bundle's wheels whose distributions the machine lacks; a
preflight without goldens fails the run and says so first; each stage's plan fits one device
call; the GPU tests collect without lmdb and onnx, which the GPU machine lacks."""
import importlib.metadata
import json
import os
import re
import shutil
import sys
import types
import zipfile

import pytest
from helpers import watchdog

from helpers.paths import CORPUS, GOLDEN, ROOT, require

sys.path.insert(0, str(ROOT / 'tools'))

from gpu_bundle import WHEELS  # noqa: E402
from gpu_check import PSPNET, STEPS  # noqa: E402
from gpu_check_report import install_wheels, wheel_name  # noqa: E402

#: what one device call may spend on its steps: 6 of its at most 10 minutes, in 15 minutes of
#: GPU time that also pay for the machine's start and a second call
STAGE_SECONDS = 330
STAGE_STEPS = {1: ['compile-kernels', 'gpu-tests', 'train-reference', 'train-gpu'],
               2: ['compile-kernels', 'cudnn-tests', 'syncbn', 'resnet50', 'pspnet',
                   'efficiency']}
MIB = 2 ** 20


def run(command, cwd=ROOT, env=None, timeout=300):
    return watchdog.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                        limit=timeout)


def alone(**extra):
    """The environment of a checkout that stands alone: no CAFFE_SYNCBN_SHARED, nothing of
    this checkout on the path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ('CAFFE_SYNCBN_SHARED', 'PYTHONPATH', 'CAFFE_SYNCBN_REQUIRE_DATA')}
    return dict(env, **extra)


@pytest.mark.parametrize('stage', sorted(STAGE_STEPS))
def test_each_stage_plans_one_device_call_and_starts_nothing(stage, tmp_path):
    out = tmp_path / 'report'
    result = run([sys.executable, 'tools/gpu_check.py', '--stage', str(stage), '--dry-run',
                  '--out', str(out)], timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith('stage %d: ' % stage)
    steps = [re.match(r'^([\w-]+) +(\d+) s  \S', line) for line in lines[1:-1]]
    assert all(steps), lines
    assert [m.group(1) for m in steps] == STAGE_STEPS[stage]
    total = int(re.fullmatch(r'total: (\d+) s', lines[-1]).group(1))
    assert total == sum(int(m.group(2)) for m in steps) <= STAGE_SECONDS
    assert not out.exists()


def test_the_frontend_the_tests_define_graphs_with_is_the_one_the_bundle_carries():
    pins = re.findall(r"'nvidia-cudnn-frontend==([\d.]+)'", (ROOT / 'Makefile').read_text())
    assert pins and ['nvidia-cudnn-frontend==%s' % pins[0]] == [
        wheel for wheel in WHEELS if wheel.startswith('nvidia-cudnn-frontend==')]


def test_every_step_belongs_to_a_stage():
    assert {step.name for step in STEPS} == set(STAGE_STEPS[1] + STAGE_STEPS[2])


def pure_wheel(folder, name, version, files=()):
    """A pure-Python wheel of the distribution ``name``, as `pip download` leaves one in the
    bundle, holding ``files`` ((path, text) pairs)."""
    path = folder / ('%s-%s-py3-none-any.whl' % (name, version))
    info = '%s-%s.dist-info/' % (name, version)
    with zipfile.ZipFile(path, 'w') as wheel:
        for file, text in files:
            wheel.writestr(file, text)
        wheel.writestr(info + 'METADATA', 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n'
                       % (name, version))
        wheel.writestr(info + 'WHEEL', 'Wheel-Version: 1.0\nGenerator: tests\n'
                       'Root-Is-Purelib: true\nTag: py3-none-any\n')
        wheel.writestr(info + 'RECORD', '')
    return path


# `import cudnn` where the frontend finds no libcudnn: its version, and the error that its
# backend_version() raises then (the real wheel's, on a machine without nvidia-cudnn-cu13)
STAND_IN_FRONTEND = """__version__ = '1.32.0'


def backend_version():
    raise RuntimeError('Unable to find symbol cudnnGetVersion')
"""


def bundle_wheels(folder):
    """A distribution this python lacks, the cuDNN frontend's module in a stand-in one, and
    numpy at a version it does not have."""
    folder.mkdir()
    pure_wheel(folder, 'gpubundleprobe', '1.0', [('gpubundleprobe/__init__.py', '')])
    pure_wheel(folder, 'gpubundlecudnn', '1.32.0', [('cudnn/__init__.py', STAND_IN_FRONTEND)])
    pure_wheel(folder, 'numpy', '0.0.1')


@pytest.fixture(scope='module')
def without_goldens(tmp_path_factory):
    """The preflight alone on reference data that holds only wheels."""
    shared = tmp_path_factory.mktemp('shared')
    bundle_wheels(shared / 'wheels')
    out = tmp_path_factory.mktemp('report')
    result = run([sys.executable, 'tools/gpu_check.py', '--only', 'preflight', '--out',
                  str(out)], env=alone(CAFFE_SYNCBN_SHARED=str(shared)))
    return result, (out / 'report.md').read_text()


def test_a_preflight_without_goldens_fails_the_run_and_says_so_first(without_goldens):
    result, report = without_goldens
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    first = report.splitlines()[2]
    assert first.startswith('**FAILED**: the preflight misses ') and 'goldens' in first \
        and 'PSPNet-50' in first, report
    missing = [line for line in report.splitlines() if line.startswith('- missing: goldens:')]
    assert len(missing) == 1 and 'make gpu-bundle' in missing[0], report


def test_the_bundles_wheels_that_the_machine_lacks_are_installed_before_the_preflight(
        without_goldens):
    result, report = without_goldens
    numpy = importlib.metadata.version('numpy')
    assert re.search(r"^\| bundled wheels \| installed gpubundlecudnn 1\.32\.0, gpubundleprobe "
                     r"1\.0; the machine's own numpy %s \|$" % re.escape(numpy), report, re.M), \
        report
    packages = re.search(r'^\| packages \| (.*) \|$', report, re.M).group(1).split(', ')
    assert 'gpubundleprobe 1.0' in packages and 'numpy %s' % numpy in packages, report
    # the probe imported the installed frontend; its libcudnn is a missing thing of its own
    assert re.search(r'^\| cuDNN frontend \| 1\.32\.0 \|$', report, re.M), report
    assert "- missing: cudnn: RuntimeError: Unable to find symbol cudnnGetVersion; the " \
        "frontend loads no libcudnn (nvidia-cudnn-cu13's); the cudnn-tests step is skipped" \
        in report.splitlines(), report
    assert not re.search(r'^- missing: cudnn_frontend:', report, re.M), report


def test_a_wheel_whose_distribution_the_machine_has_is_left_out(tmp_path, monkeypatch):
    monkeypatch.setenv('PYTHONPATH', '')
    bundle_wheels(tmp_path / 'wheels')
    check = types.SimpleNamespace(shared=str(tmp_path), work=str(tmp_path), missing=[], env={})
    names = install_wheels(check)
    assert names == ['gpubundlecudnn', 'gpubundleprobe', 'numpy'] and check.missing == []
    site = tmp_path / 'site'
    assert sorted(p.name for p in site.iterdir() if p.name.endswith('.dist-info')) == \
        ['gpubundlecudnn-1.32.0.dist-info', 'gpubundleprobe-1.0.dist-info']
    assert os.environ['PYTHONPATH'] == str(site)

    monkeypatch.setenv('PYTHONPATH', '')
    for wheel in (tmp_path / 'wheels').glob('gpubundle*'):
        wheel.unlink()
    check = types.SimpleNamespace(shared=str(tmp_path), work=str(tmp_path / 'again'),
                                  missing=[], env={})
    assert install_wheels(check) == ['numpy'] and not (tmp_path / 'again').exists()
    assert check.env['wheels'] == "the machine's own numpy %s" % \
        importlib.metadata.version('numpy') and os.environ['PYTHONPATH'] == ''


def copy_checkout(target):
    """The files that travel, tracked and untracked but not ignored, in a new git checkout."""
    listed = run(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
                 timeout=60)
    if listed.returncode:
        pytest.skip('not a git checkout: %s' % listed.stderr.strip())
    for name in filter(None, listed.stdout.split('\0')):
        if os.path.isfile(ROOT / name):
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    for command in (['git', 'init', '-q'], ['git', 'add', '-A'],
                    ['git', '-c', 'user.name=test', '-c', 'user.email=test@localhost', 'commit',
                     '-q', '-m', 'the checkout that travels']):
        assert run(command, cwd=target, timeout=60).returncode == 0


@pytest.mark.slow
def test_a_checkout_alone_with_its_bundle_finds_the_goldens_and_the_corpus(tmp_path):
    shared = require(GOLDEN).parent
    require(CORPUS / os.path.basename(PSPNET))
    checkout = tmp_path / 'checkout'       # nothing named shared beside it
    copy_checkout(checkout)
    tool = [sys.executable, 'tools/gpu_bundle.py', '--from', str(shared)]
    made = run(tool, cwd=checkout, env=alone())
    assert made.returncode == 0, made.stderr
    bundle = checkout / '.gpu-bundle'
    summary = json.loads((bundle / 'bundle.json').read_text())
    assert summary['travels'] <= 60 * MIB
    assert sorted(wheel_name(wheel) for wheel in summary['wheels']) == \
        sorted(pin.split('==')[0] for pin in WHEELS)
    assert (bundle / 'golden' / 'index.json').is_file() and (bundle / PSPNET).is_file()
    calls = re.findall(r'^stage (\d), .*:\n  carry: (.*)\n  timeout_s: (\d+)\n  command: (.*)$',
                       made.stdout, re.M)
    assert [stage for stage, *_ in calls] == ['1', '2'], made.stdout
    for stage, carry, timeout, command in calls:
        assert json.loads(carry) == ['.gpu-bundle'] and int(timeout) <= 400
        assert re.fullmatch('PYTHONUNBUFFERED=1 PYTHONPATH=. python3 tools/gpu_check.py '
                            '--stage %s --commit [0-9a-f]{40}' % stage, command), command

    too_big = run(tool + ['--limit-mib', '1'], cwd=checkout, env=alone())
    assert too_big.returncode == 1 and too_big.stdout == ''
    assert re.fullmatch(r'gpu-bundle: [\d.]+ MiB would travel .* over the limit of 1 MiB: '
                        r'the bundle is not made\n', too_big.stderr), too_big.stderr
    assert sorted(p.name for p in checkout.iterdir() if p.name.startswith('.gpu-bundle')) == \
        ['.gpu-bundle'] and json.loads((bundle / 'bundle.json').read_text()) == summary

    out = tmp_path / 'report'
    preflight = run([sys.executable, 'tools/gpu_check.py', '--only', 'preflight', '--out',
                     str(out)], cwd=checkout, env=alone())
    report = (out / 'report.md').read_text()
    assert '| reference data | %s (the bundle of make gpu-bundle) |' % bundle in report, \
        preflight.stdout[-3000:] + preflight.stderr[-3000:]
    assert not re.search(r'^- missing: (goldens|PSPNet-50):', report, re.M), report

    # the tests' own lookup, with the goldens required: a golden case runs, not skips
    case = run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                'tests/test_golden_nets.py::test_golden_case[absval]'], cwd=checkout,
               env=alone(CAFFE_SYNCBN_REQUIRE_DATA='1'))
    assert case.returncode == 0 and '1 passed' in case.stdout, case.stdout[-3000:]


# Collects tests/gpu as the GPU machine would: lmdb and onnx absent (an import of them raises
# ImportError), and require_gpu passing, so that every module is imported to its end.
COLLECT = '''
import sys
blocked = sys.argv[1] == 'blocked'
for name in ('lmdb', 'onnx', 'onnxruntime') if blocked else ():
    sys.modules[name] = None
sys.path.insert(0, 'tests/gpu')
import gpu_support
gpu_support.require_gpu = lambda: None
import pytest
sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-m', 'gpu',
                      'tests/gpu']))
'''


def test_the_gpu_tests_collect_without_lmdb_and_onnx():
    collected = {}
    for mode in ('blocked', 'installed'):
        result = run([sys.executable, '-c', COLLECT, mode],
                     env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        collected[mode] = [line for line in result.stdout.splitlines() if '::' in line]
    assert collected['blocked'] == collected['installed']
    modules = {line.split('::')[0] for line in collected['blocked']}
    assert modules == {'tests/gpu/%s' % p.name for p in (ROOT / 'tests' / 'gpu').glob('test_*.py')}
