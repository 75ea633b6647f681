"""The preflight and the report of `make gpu-check` (tools/gpu_check.py).

The preflight asks a process of its own (this file, run as a script) what it can import and
see, so that the driver never holds a CUDA context (nor torch) while the steps measure the
GPU's memory. The reference data come from CAFFE_SYNCBN_SHARED, else from the bundle that
`make gpu-bundle` leaves in the checkout (a GPU machine gets the checkout alone), else from
../shared; the bundle's wheels that the machine lacks are installed first. The report is
markdown, written whole (to a temporary file, then renamed) after every step, and says first
whether the run passed.
"""
import glob
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(ROOT, '.gpu-bundle')
PACKAGES = ('numpy', 'cupy-cuda13x', 'nvidia-nccl-cu13', 'nvidia-cudnn-cu13',
            'nvidia-cudnn-frontend', 'cuda-bindings', 'torch', 'protobuf', 'h5py', 'lmdb',
            'opencv-python-headless', 'scipy', 'tqdm', 'threadpoolctl', 'onnx', 'onnxruntime',
            'pytest', 'pytest-timeout', 'pytest-xdist', 'hypothesis', 'mpi4py')


def _version(code):
    """22703 -> '2.27.3': NCCL's and cuDNN's integer versions."""
    return '%d.%d.%d' % (code // 10000, code % 10000 // 100, code % 100)


def _cuda_version(code):
    """13000 -> '13.0': CUDA's."""
    return '%d.%d' % (code // 1000, code % 1000 // 10)


def _gpu():
    import cupy
    runtime = cupy.cuda.runtime
    count = runtime.getDeviceCount()
    if count < 1:
        raise RuntimeError('CuPy sees no CUDA device')
    props = runtime.getDeviceProperties(0)
    return '%s, %.1f GiB (device 0 of %d; CuPy %s)' % (
        props['name'].decode(), props['totalGlobalMem'] / 2 ** 30, count, cupy.__version__)


def _cuda():
    import cupy
    runtime = cupy.cuda.runtime
    return 'runtime %s, driver %s' % (_cuda_version(runtime.runtimeGetVersion()),
                                      _cuda_version(runtime.driverGetVersion()))


def _nccl():
    from cupy.cuda import nccl
    if not getattr(nccl, 'available', True):
        raise ImportError('cupy.cuda.nccl is not available (pip install nvidia-nccl-cu13)')
    return _version(nccl.get_version())


def _torch():
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError('torch %s sees no CUDA device' % torch.__version__)
    return torch.__version__


def _torch_cudnn():
    import torch
    return _version(torch.backends.cudnn.version())


def _cudnn_frontend():
    import cudnn          # the wheel alone: it loads libcudnn only when asked for its version
    return cudnn.__version__


def _cudnn():
    """cuDNN's version, from the libcudnn that the frontend loads (nvidia-cudnn-cu13's in
    this python's site-packages, else the linker's): the one the cuDNN engine runs."""
    import cudnn
    return _version(cudnn.backend_version())


def _module(name):
    return lambda: getattr(__import__(name), '__version__', 'found')


# key: (how to find it, what its absence costs (None: nothing), the key it needs first: one
# listed above it)
PROBES = {
    'gpu': (_gpu, 'every GPU step is skipped', None),
    'cuda': (_cuda, None, 'gpu'),
    'nccl': (_nccl, 'the NCCL tests fail', 'gpu'),
    'torch': (_torch, "the benchmarks' torch references are skipped", 'gpu'),
    'torch_cudnn': (_torch_cudnn, None, 'torch'),
    'cudnn_frontend': (_cudnn_frontend, 'the cudnn-tests step is skipped', None),
    'cudnn': (_cudnn, "the frontend loads no libcudnn (nvidia-cudnn-cu13's); the cudnn-tests "
              'step is skipped', 'cudnn_frontend'),
    'cv2': (_module('cv2'), "the training steps fail (the demo's dataset needs OpenCV)", None),
    'xdist': (_module('xdist'), 'the GPU tests run in one process', None),
    'timeout': (_module('pytest_timeout'), "the GPU tests run without pytest's time limit",
                None),
}


def probe(extra=()):
    """{key: version or description, key + '_error': why not} for PROBES (a key whose
    prerequisite is missing is not tried), and the versions of the installed PACKAGES and
    of the ``extra`` distributions (the bundle's wheels)."""
    found = {}
    for key, (find, _, needs) in PROBES.items():
        if needs and needs not in found:
            continue
        try:
            found[key] = find()
        except Exception as exc:            # ImportError, CUDA errors: each a missing thing
            found[key + '_error'] = ('%s: %s' % (type(exc).__name__, exc)).splitlines()[0]
    found['packages'] = {}
    for name in PACKAGES + tuple(extra):
        try:
            found['packages'][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def git_commit():
    try:
        head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'],
                               cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + (' (with uncommitted changes)' if dirty.stdout.strip() else '')


def environment():
    return {'started': time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()),
            'python': '%s (%s)' % (platform.python_version(), sys.executable),
            'host': '%s, %d CPU cores' % (platform.node(), os.cpu_count() or 0)}


def shared_folder():
    """Where the goldens and the corpus are: CAFFE_SYNCBN_SHARED, else the bundle of
    `make gpu-bundle` in the checkout, else ../shared (tests/helpers/paths.py looks the same
    way)."""
    if os.environ.get('CAFFE_SYNCBN_SHARED'):
        return os.path.abspath(os.environ['CAFFE_SYNCBN_SHARED'])
    if os.path.isdir(BUNDLE):
        return BUNDLE
    return os.path.join(os.path.dirname(ROOT), 'shared')


def wheel_name(path):
    """'nvidia_cudnn_frontend-1.32.0-cp312-....whl' -> 'nvidia-cudnn-frontend', its
    distribution's name."""
    return os.path.basename(path).split('-')[0].replace('_', '-')


def wheel_version(path):
    return os.path.basename(path).split('-')[1]


def installed_version(name):
    """The version of the distribution ``name`` that this python finds, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_wheels(check):
    """Install the wheels of ``check.shared``/wheels (the GPU machine has no registry) whose
    distributions this python lacks into the run's work folder, on the path of the preflight
    and of every step: a distribution the machine has stays its own (a cuda-bindings built
    for its driver, say). check.env['wheels'] says which were installed and which the
    machine had; a failed install is a missing thing. The names of the bundle's
    distributions."""
    wheels = sorted(glob.glob(os.path.join(check.shared, 'wheels', '*.whl')))
    names = [wheel_name(wheel) for wheel in wheels]
    had = {name: installed_version(name) for name in names}
    wanted = [wheel for wheel in wheels if had[wheel_name(wheel)] is None]
    kept = ['%s %s' % (name, had[name]) for name in names if had[name]]
    done = ["the machine's own %s" % ', '.join(kept)] if kept else []
    if wanted:
        failure = pip_install(wanted, os.path.join(check.work, 'site'))
        if failure:
            check.missing.append('wheels: installing %s failed: %s; the steps that need them '
                                 'fail' % (', '.join(map(os.path.basename, wanted)), failure))
        else:
            done.insert(0, 'installed %s' % ', '.join(
                '%s %s' % (wheel_name(wheel), wheel_version(wheel)) for wheel in wanted))
    check.env['wheels'] = '; '.join(done) or 'none'
    return names


def pip_install(wheels, target):
    """Install ``wheels`` into ``target`` and put it first on PYTHONPATH (what the probe and
    the steps inherit); None, else why not in one line."""
    try:
        result = subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-index',
                                 '--no-deps', '--no-compile', '--no-cache-dir', '--target',
                                 target] + wheels, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return 'pip took over 300 s'
    if result.returncode:
        return (result.stderr.strip() or 'exit status %d' % result.returncode).splitlines()[-1]
    os.environ['PYTHONPATH'] = os.pathsep.join(
        [target] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p])
    return None


def preflight(check, commit=None, pspnet=None):
    """Fill check.found (what each step needs) and check.missing (one line per missing
    thing) from the bundle's wheels, a probe process, the goldens and the PSPNet-50
    prototxt."""
    extra = install_wheels(check)
    try:
        result = subprocess.run([sys.executable, os.path.abspath(__file__)] + extra,
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
        found = json.loads(result.stdout) if result.returncode == 0 else \
            {'gpu_error': 'the probe failed: %s' % result.stderr.strip()[-300:]}
    except subprocess.TimeoutExpired:   # a driver that hangs: every GPU step would too
        found = {'gpu_error': 'the probe (importing CuPy, asking for devices) took over 120 s'}
    check.env.update(commit=commit or git_commit() or 'unknown (not a git checkout: pass '
                     '--commit)', packages=found.pop('packages', {}),
                     shared=check.shared + (' (the bundle of make gpu-bundle)'
                                            if check.shared == BUNDLE else ''))
    for key, (_, cost, _) in PROBES.items():
        if key in found:
            check.found[key] = check.env[key] = found[key]
        elif cost and key + '_error' in found:
            check.missing.append('%s: %s; %s' % (key, found.get(key + '_error', 'not probed'),
                                                 cost))
    fix = 'run `make gpu-bundle` before sending the checkout, or set CAFFE_SYNCBN_SHARED'
    goldens = os.path.join(check.shared, 'golden')
    if os.path.isdir(goldens) and os.listdir(goldens):
        check.found['goldens'] = goldens
    else:
        check.missing.append('goldens: %s is missing or empty (%s); the GPU tests that need '
                             'them fail' % (goldens, fix))
    if pspnet and os.path.isfile(pspnet):
        check.found['pspnet'] = pspnet
    else:
        check.missing.append('PSPNet-50: %s is missing (%s); the pspnet and efficiency steps '
                             'are skipped' % (pspnet, fix))


def _table(rows):
    return ['| %s |' % ' | '.join(str(cell).replace('|', '\\|') for cell in row) for row in rows]


def verdict(check):
    """The report's first line: FAILED (what the preflight missed, the steps that failed or
    were skipped), else UNFINISHED (a run killed on the way leaves this), else PASSED."""
    reasons = []
    if check.missing:
        reasons.append('the preflight misses %s' % ', '.join(line.split(':')[0]
                                                             for line in check.missing))
    for status in ('failed', 'skipped'):
        steps = [r['step'] for r in check.results if r['status'] == status]
        if steps:
            reasons.append('%s: %s' % (status, ', '.join(steps)))
    if reasons:
        return '**FAILED**: %s.' % '; '.join(reasons)
    if len(check.results) < len(check.planned):
        return '**UNFINISHED**: %d of %d steps done (%s).' % (
            len(check.results), len(check.planned), ', '.join(check.planned))
    return '**PASSED**: the preflight found everything and every step passed (%s).' % (
        ', '.join(check.planned) or 'no step was asked for')


def report_lines(check):
    env = check.env
    lines = ['# make gpu-check', '', verdict(check), '', '| | |', '|---|---|']
    lines += _table([('started', env['started']), ('commit', env.get('commit', '?')),
                     ('GPU', env.get('gpu', 'none')), ('CUDA', env.get('cuda', '-')),
                     ('NCCL', env.get('nccl', '-')), ('cuDNN', env.get('cudnn', '-')),
                     ('cuDNN frontend', env.get('cudnn_frontend', '-')),
                     ('cuDNN (torch)', env.get('torch_cudnn', '-')),
                     ('bundled wheels', env.get('wheels', 'none')),
                     ('python', env['python']), ('host', env['host']),
                     ('reference data', env.get('shared', '-')),
                     ('packages', ', '.join('%s %s' % item
                                            for item in sorted(env.get('packages', {}).items())))])
    lines += ['', '## Preflight', '']
    lines += ['- missing: %s' % line for line in check.missing] or ['- everything found']
    lines += ['', '## Steps', '', '| step | result | seconds | log | note |',
              '|---|---|---|---|---|']
    lines += _table([(r['step'], r['status'], '%.0f' % r.get('seconds', 0), r['log'],
                      r.get('note', '')) for r in check.results])
    for r in check.results:
        lines += ['', '### %s' % r['step'], '']
        lines += ['`%s`' % command.replace(ROOT + os.sep, '') for command in r['commands']]
        if r['figures']:
            lines += ['', '```'] + r['figures'][-40:] + ['```']
        if r.get('details'):
            lines += ['', '| iteration | cpu:2 loss | gpu:0,0 loss | relative difference | '
                      'tolerance |', '|---|---|---|---|---|']
            lines += _table([(i, '%g' % a, '%g' % b, '%.2e' % d, '%.0e' % t)
                             for i, a, b, d, t in r['details']])
    return lines


def write_report(path, check):
    temporary = path + '.tmp'
    with open(temporary, 'w') as f:
        f.write('\n'.join(report_lines(check)) + '\n')
    os.replace(temporary, path)


if __name__ == '__main__':
    print(json.dumps(probe(sys.argv[1:])))
