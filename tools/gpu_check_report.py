"""The preflight and the report of `make gpu-check` (tools/gpu_check.py).

The preflight asks a process of its own (this file, run as a script) what it can import and
see, so that the driver never holds a CUDA context (nor torch) while the steps measure the
GPU's memory. The report is markdown, written whole (to a temporary file, then renamed)
after every step.
"""
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('numpy', 'cupy-cuda13x', 'nvidia-nccl-cu13', 'nvidia-cudnn-cu13', 'torch',
            'protobuf', 'h5py', 'lmdb', 'opencv-python-headless', 'scipy', 'tqdm',
            'threadpoolctl', 'onnx', 'onnxruntime', 'pytest', 'pytest-timeout', 'pytest-xdist',
            'hypothesis', 'mpi4py')


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


def _cudnn():
    import torch
    return _version(torch.backends.cudnn.version())


def _module(name):
    return lambda: getattr(__import__(name), '__version__', 'found')


# key: (how to find it, what its absence costs (None: nothing), the key it needs first)
PROBES = {
    'gpu': (_gpu, 'every GPU step is skipped', None),
    'cuda': (_cuda, None, 'gpu'),
    'nccl': (_nccl, 'the NCCL tests fail', 'gpu'),
    'cudnn': (_cudnn, None, 'torch'),
    'torch': (_torch, "the benchmarks' torch references are skipped", 'gpu'),
    'cv2': (_module('cv2'), "the training steps fail (the demo's dataset needs OpenCV)", None),
    'xdist': (_module('xdist'), 'the GPU tests run in one process', None),
    'timeout': (_module('pytest_timeout'), "the GPU tests run without pytest's time limit",
                None),
}


def probe():
    """{key: version or description, key + '_error': why not} for PROBES (a key whose
    prerequisite is missing is not tried), and the installed packages' versions."""
    found = {}
    for key, (find, _, needs) in PROBES.items():
        if needs and needs not in found:
            continue
        try:
            found[key] = find()
        except Exception as exc:            # ImportError, CUDA errors: each a missing thing
            found[key + '_error'] = ('%s: %s' % (type(exc).__name__, exc)).splitlines()[0]
    found['packages'] = {}
    for name in PACKAGES:
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


def preflight(check, commit=None, pspnet=None):
    """Fill check.found (what each step needs) and check.missing (one line per missing
    thing) from a probe process, the goldens and the PSPNet-50 prototxt."""
    try:
        result = subprocess.run([sys.executable, os.path.abspath(__file__)],
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
        found = json.loads(result.stdout) if result.returncode == 0 else \
            {'gpu_error': 'the probe failed: %s' % result.stderr.strip()[-300:]}
    except subprocess.TimeoutExpired:   # a driver that hangs: every GPU step would too
        found = {'gpu_error': 'the probe (importing CuPy, asking for devices) took over 120 s'}
    check.env.update(commit=commit or git_commit() or 'unknown (not a git checkout: pass '
                     '--commit)', packages=found.pop('packages', {}))
    for key, (_, cost, _) in PROBES.items():
        if key in found:
            check.found[key] = check.env[key] = found[key]
        elif cost and key + '_error' in found:
            check.missing.append('%s: %s; %s' % (key, found.get(key + '_error', 'not probed'),
                                                 cost))
    goldens = os.path.join(check.shared, 'golden')
    if os.path.isdir(goldens) and os.listdir(goldens):
        check.found['goldens'] = goldens
    else:
        check.missing.append('goldens: %s is missing or empty (set CAFFE_SYNCBN_SHARED to a copy '
                             'of ../shared); the GPU tests that need them fail' % goldens)
    if pspnet and os.path.isfile(pspnet):
        check.found['pspnet'] = pspnet
    else:
        check.missing.append('PSPNet-50: %s is missing; the pspnet and efficiency steps are '
                             'skipped' % pspnet)


def _table(rows):
    return ['| %s |' % ' | '.join(str(cell).replace('|', '\\|') for cell in row) for row in rows]


def report_lines(check):
    env = check.env
    lines = ['# make gpu-check', '', '| | |', '|---|---|']
    lines += _table([('started', env['started']), ('commit', env.get('commit', '?')),
                     ('GPU', env.get('gpu', 'none')), ('CUDA', env.get('cuda', '-')),
                     ('NCCL', env.get('nccl', '-')), ('cuDNN (torch)', env.get('cudnn', '-')),
                     ('python', env['python']), ('host', env['host']),
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
    print(json.dumps(probe()))
