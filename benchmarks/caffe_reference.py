"""What net_time.py and memory.py share to run BVLC Caffe's `caffe time` beside ours.

Both programs get the same prototxt (``timing.timing_net_param``: Input layers of the
asked batch, backward forced), each run is its own process, and the peak memory of
both is measured the same way: a small launcher forks, the child execs the program,
and the launcher reads the child's ru_maxrss from wait4. (A launcher of its own keeps
the benchmark driver's memory out of the figure: Linux carries the memory of the
process a program was spawned from into its ru_maxrss.)
"""
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LAUNCHER = r'''
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[1], sys.argv[1:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
sys.stderr.write('\nPEAK_RSS_KB %d\n' % usage.ru_maxrss)
sys.exit(os.waitstatus_to_exitcode(status))
'''


def _error(message):
    from caffe_syncbn.errors import CaffeError  # one line from run_main, no traceback
    return CaffeError(message)


def blas_env(threads):
    """The environment of a measured run: ``threads`` BLAS threads for either OpenBLAS
    (numpy's and the one Caffe links), both on the kernels numpy's OpenBLAS chose for this
    CPU (``blas_core``), our package importable."""
    env = dict(os.environ)
    if threads:
        for name in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS'):
            env[name] = str(threads)
    env.setdefault('OPENBLAS_CORETYPE', blas_core())
    env['PYTHONPATH'] = ROOT + os.pathsep + env.get('PYTHONPATH', '')
    return env


def blas_core():
    """The kernels numpy's OpenBLAS runs on this CPU ('SkylakeX', 'Haswell', ...).

    An older OpenBLAS may not know a newer CPU and fall back to its SSE3 kernels
    ('Prescott'): Debian 12's 0.3.21, which the reference Caffe links, does so on Xeons of
    2023 and later, and its GEMMs then run at a third of their speed. Naming the core in
    OPENBLAS_CORETYPE puts both programs on the same kernels; `caffe_time` reports the
    one Caffe ran."""
    import numpy  # noqa: F401  (loads the OpenBLAS that threadpoolctl asks)
    from threadpoolctl import threadpool_info
    cores = [info.get('architecture') for info in threadpool_info()
             if info.get('internal_api') == 'openblas']
    return next((core for core in cores if core), '')


def run_measured(command, env, timeout=1800):
    """Run ``command``; return (stdout, stderr, peak resident KiB)."""
    proc = subprocess.run([sys.executable, '-I', '-S', '-c', _LAUNCHER] + list(command),
                          env=env, capture_output=True, text=True, timeout=timeout)
    found = re.search(r'^PEAK_RSS_KB (\d+)$', proc.stderr, re.M)
    if proc.returncode != 0 or not found:
        tail = '\n'.join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise _error('%s exited with %d: %s' % (command[0], proc.returncode,
                                                tail.replace('\n', ' | ')))
    return proc.stdout, proc.stderr, int(found.group(1))


def write_timing_prototxt(model, batch, folder, training=False):
    """The prototxt both programs time (see timing.timing_net_param), ``as_training`` if
    asked; its path."""
    from google.protobuf import text_format

    from caffe_syncbn.analysis.timing import timing_net_param
    param = timing_net_param(model, batch)
    path = os.path.join(folder, 'timed.prototxt')
    with open(path, 'w') as f:
        f.write(text_format.MessageToString(as_training(param) if training else param))
    return path


def as_training(param):
    """A deploy or evaluation net as its users train it: batch statistics in every batch
    norm (BatchNorm without use_global_stats, BN and SyncBN not frozen) and, where it has
    no loss, a SoftmaxWithLoss against a label input of zeros, on the last layer's top (on
    its bottom when that layer is a Softmax)."""
    from caffe_syncbn import TRAIN, Net
    for layer in param.layer:
        if layer.type == 'BatchNorm':
            layer.batch_norm_param.ClearField('use_global_stats')
        elif layer.type in ('BN', 'SyncBN'):
            layer.bn_param.frozen = False
    if any(layer.type.endswith('Loss') for layer in param.layer):
        return param
    last = param.layer[-1]
    scores = last.bottom[0] if last.type == 'Softmax' else last.top[0]
    if last.type == 'Softmax':
        del param.layer[-1]
    shape = Net(param, TRAIN).blobs[scores].shape        # built once, for the scores' shape
    label = param.layer.add(name='label', type='Input', top=['label'])
    label.input_param.shape.add(dim=(shape[0],) + ((1,) + shape[2:] if len(shape) > 2 else ()))
    param.layer.add(name='loss', type='SoftmaxWithLoss', bottom=[scores, 'label'], top=['loss'])
    return param


_CAFFE_TOTALS = {'forward_ms': r'Average Forward pass: ([\d.]+) ms',
                 'backward_ms': r'Average Backward pass: ([\d.]+) ms',
                 'total_ms': r'Average Forward-Backward: ([\d.]+) ms'}
_CAFFE_LAYER = re.compile(r'\]\s+(\S+)\t(forward|backward): ([\d.]+) ms\.')


def caffe_time(caffe, prototxt, iterations, env):
    """`caffe time` of ``prototxt`` (TRAIN, forward+backward): totals in ms, per-layer ms
    {name: forward + backward} and the peak in KiB."""
    _, log, peak = run_measured([caffe, 'time', '-model', prototxt, '-iterations',
                                 str(iterations), '-phase', 'TRAIN'],
                                dict(env, OPENBLAS_VERBOSE='2'))
    core = re.search(r'^Core: (\S+)', log, re.M)
    result = {'peak_kb': peak, 'layers': {}, 'blas_core': core.group(1) if core else '?'}
    for key, pattern in _CAFFE_TOTALS.items():
        found = re.search(pattern, log)
        if not found:
            raise _error('caffe time printed no "%s" line' % pattern.split(':')[0])
        result[key] = float(found.group(1))
    for name, _, ms in _CAFFE_LAYER.findall(log):
        result['layers'][name] = result['layers'].get(name, 0.0) + float(ms)
    return result


def temporary_folder():
    return tempfile.TemporaryDirectory(prefix='caffe-compare-')
