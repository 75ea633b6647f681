#!/usr/bin/env python3
"""`make gpu-check`: every check that needs a GPU, in two stages of one device call each, with
a markdown report.

    PYTHONPATH=. python3 tools/gpu_check.py [--stage 1|2 | --only STEP,...] [--dry-run]
                                            [--out DIR] [--budget SECONDS] [--commit SHA]

Stage 1 is the proof: every CUDA kernel module compiled once into one CuPy cache that the
later steps share, the GPU tests with the goldens (but the cuDNN engine's), and the demo net
trained with -sync_bn on gpu:0,0 against cpu:2, loss for loss. Stage 2 runs the cuDNN
engine's GPU tests, which decide whether the benchmarks time it, then the benchmarks:
SyncBN, ResNet-50, PSPNet-50, and the expected efficiency on 8 and 16 GPUs from the
measured step. Without --stage or --only, every step runs. Each step is a process of its own
with its own time limit, cut to what is left of --budget (by default the sum of the limits),
which starts counting after the preflight. --dry-run prints the plan and starts nothing.

A preflight first writes one line per missing thing (CuPy, a device, NCCL, the cuDNN
frontend and its libcudnn, the goldens and the PSPNet-50 prototxt of the reference data:
CAFFE_SYNCBN_SHARED, else the bundle of `make gpu-bundle` in the checkout, else ../shared);
the steps that cannot run without it are skipped, the others run, and the run fails.

The report goes to $OUT when set, else out/gpu/: report.md, rewritten after every step (a
killed run still leaves one), and steps.log, the output of every step; two files in one
flat folder, as the device tools return it. The exit status is 0 only when nothing was
missing and every step passed. On a machine without a GPU, --only train-reference runs the
CPU half of the training comparison.
"""
import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'tools'))

from gpu_check_report import (environment, preflight, shared_folder, verdict,  # noqa: E402
                              write_report)
from gpu_check_training import (ITERATIONS, compare_runs,  # noqa: E402
                                prepare_training, train_command)

PYTHON = sys.executable
CUDNN_TESTS = 'tests/gpu/test_gpu_cudnn.py'
PSPNET = os.path.join('corpus', 'hszhao_PSPNet__evaluation_prototxt_pspnet50_ADE20K_473.prototxt')
LOG = 'steps.log'
STAGES = {1: 'the proof: the kernels compile, the GPU tests pass with the goldens, -sync_bn '
             'trains on gpu:0,0 as on cpu:2',
          2: "the cuDNN engine's GPU tests, then the benchmarks: SyncBN, ResNet-50 and "
             'PSPNet-50 against torch, the expected efficiency'}


class Step:
    """One step of the ``stages`` it belongs to: ``commands(check)`` gives its argv lists (or
    raises Skip), ``figures`` the patterns of the output lines that go into the report,
    ``needs`` what the preflight must have found, ``what`` its line of the plan."""

    def __init__(self, name, stages, seconds, what, commands, figures, needs=('gpu',), env=None,
                 after=None):
        self.name, self.stages, self.seconds, self.what = name, stages, seconds, what
        self.commands, self.figures = commands, figures
        self.needs, self.env, self.after = needs, env or {}, after


class Skip(Exception):
    """A step that cannot run: its message goes into the report."""


def compile_kernels(check):
    return [[PYTHON, 'tools/gpu_check_kernels.py']]


def pytest_command(check, markers, paths, workers=1):
    parallel = ['-n', str(workers)] if workers > 1 and check.found.get('xdist') else []
    limit = ['--timeout=120'] if check.found.get('timeout') else []
    return [PYTHON, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-m', markers] + limit + \
        parallel + paths


def gpu_tests(check):
    return [pytest_command(check, 'gpu and not cudnn', ['tests/gpu'], workers=4)]


def cudnn_tests(check):
    return [pytest_command(check, 'cudnn', [CUDNN_TESTS])]


def engine_tested(check):
    """Whether the cudnn-tests step passed in this run: only then do the benchmarks time the
    cuDNN engine."""
    return any(r['step'] == 'cudnn-tests' and r['status'] == 'passed' for r in check.results)


def train(devices):
    def commands(check):
        prepare_training(check.work, check.say)
        return [train_command(PYTHON, check.work, devices)]
    return commands


def syncbn_benchmark(check):
    return [[PYTHON, 'benchmarks/syncbn_gpu.py', '--shapes', '8x256x128x128', '--repeats', '5']]


def resnet50_benchmark(check):
    """The cuDNN engine against torch, TF32 off (the goal) and on, then im2col TF32 off (the
    engine's gain); without a passed cudnn-tests, im2col TF32 off and on."""
    command = [PYTHON, 'benchmarks/train_gpu.py', '--devices', 'gpu:0', '--batch', '32',
               '--warmup', '1', '--iters', '3']
    if not engine_tested(check):
        return [command + ['--engine', 'im2col'], command + ['--engine', 'im2col', '--tf32']]
    return [command + ['--engine', 'cudnn'], command + ['--engine', 'cudnn', '--tf32'],
            command + ['--engine', 'im2col']]


def pspnet_benchmark(check):
    if not check.found.get('pspnet'):
        raise Skip('PSPNet-50 prototxt not found: %s' % os.path.join(check.shared, PSPNET))
    command = [PYTHON, 'benchmarks/train_gpu.py', '--model', check.found['pspnet'], '--sync-bn']
    timed = ['--memory-plan', 'auto', '--warmup', '1', '--iters', '3']
    return [command + ['--devices', 'gpu:0,0', '--batch', '4'] + timed,   # 2 per replica
            command + ['--devices', 'gpu:0', '--batch', '4'] + timed,     # twice that, alone
            command + ['--devices', 'gpu:0', '--fit', 'off,auto']]


def syncbn_ratios(check):
    """The syncbn step's note: float32, one replica: the share of the copy bandwidth, and
    the speed against torch's BatchNorm2d."""
    row = re.search(r'^8x256x128x128 +float32 +1 \|.* (\d+)% \|.* (\d+)% \|(.*)$',
                    check.outputs.get('syncbn', ''), re.M)
    if not row:
        return True, 'no ratios: no float32 row of one replica', None
    torch = re.search(r'([\d.]+)x$', row.group(3))
    return True, 'float32: forward %s%%, backward %s%% of the copy bandwidth; %s' % (
        row.group(1), row.group(2), '%sx torch' % torch.group(1) if torch else 'no torch'), None


def resnet50_ratios(check):
    """The resnet50 step's note: per run, ours / torch in images/s with its engine and TF32;
    the cuDNN engine's images/s over im2col's, TF32 off; and why the engine did not run."""
    ratios, speeds = [], {}
    for run in re.split(r'^(?=net: )', check.outputs.get('resnet50', ''), flags=re.M):
        header = re.match(r'net: .*; TF32 (on|off); engine (\w+)$', run, re.M)
        speed = re.search(r'^caffe_syncbn .* ([\d.]+) images/s$', run, re.M)
        ratio = re.search(r'^ratio \(ours / torch\): ([\d.]+)x', run, re.M)
        if not header:
            continue
        tf32, engine = header.groups()
        if speed:
            speeds[engine, tf32] = float(speed.group(1))
        if ratio:
            ratios.append('%s TF32 %s %sx' % (engine, tf32, ratio.group(1)))
    notes = ['ours / torch: %s' % ', '.join(ratios) if ratios else
             'no ratios against torch: torch was skipped or a run failed']
    if ('cudnn', 'off') in speeds and ('im2col', 'off') in speeds:
        notes.append('cudnn / im2col, TF32 off: %.2fx' % (speeds['cudnn', 'off'] /
                                                         speeds['im2col', 'off']))
    if not engine_tested(check):
        notes.append('no cudnn runs: cudnn-tests did not pass in this run')
    return True, '; '.join(notes), None


def pspnet_ratios(check):
    """The pspnet step's note: 2 replicas of 2 images on one GPU against 1 replica of 4."""
    output = check.outputs.get('pspnet', '')
    step = [float(v) for v in re.findall(r'^caffe_syncbn +([\d.]+) ms/step', output, re.M)]
    peak = [float(v) for v in re.findall(r'^peak GPU memory: ([\d.]+) MiB', output, re.M)]
    if len(step) < 2 or len(peak) < 2:
        return True, 'no ratios: a timed run printed no step or no peak', None
    return True, 'gpu:0,0 / gpu:0: step %.2fx, peak GPU memory %.2fx' % (
        step[0] / step[1], peak[0] / peak[1]), None


def efficiency(check):
    pspnet = check.outputs.get('pspnet', '')
    step = re.findall(r'^caffe_syncbn +([\d.]+) ms/step', pspnet, re.M)
    net = re.findall(r'^batch norms: (\d+); params: ([\d.]+) MiB', pspnet, re.M)
    if len(step) < 2 or len(net) < 2:
        raise Skip('needs the step time of PSPNet-50 on one replica (the pspnet step)')
    return [[PYTHON, 'benchmarks/efficiency.py', '--step-s', '%g' % (float(step[1]) / 1e3),
             '--batch-norms', net[1][0], '--params-mib', net[1][1]]]


PYTEST_FIGURES = [r'\d+ (passed|failed|error)', r'^(FAILED|ERROR|SKIPPED)[ :]']
STEPS = [
    Step('compile-kernels', (1, 2), 35, 'every cuda/*.cu module compiled once, into the CuPy '
         'cache (CUPY_CACHE_DIR) that the later steps share', compile_kernels,
         [r'^\w+: compiled', r'^compiled ']),
    Step('gpu-tests', (1,), 195, "pytest -m 'gpu and not cudnn' tests/gpu, 4 workers, "
         'CAFFE_SYNCBN_REQUIRE_DATA=1', gpu_tests, PYTEST_FIGURES,
         env={'CAFFE_SYNCBN_REQUIRE_DATA': '1'}),
    Step('train-reference', (1,), 30, 'the demo net trained %d iterations with -sync_bn on '
         '-cpu_devices 2' % ITERATIONS, train('cpu'), [r'Iteration %d, loss' % ITERATIONS],
         needs=('cv2',)),
    Step('train-gpu', (1,), 70, 'the same on -gpu 0,0, loss for loss against train-reference',
         train('gpu'), [r'Iteration %d, loss' % ITERATIONS], needs=('gpu', 'cv2'),
         after=compare_runs),
    Step('cudnn-tests', (2,), 40, 'pytest -m cudnn %s, CAFFE_SYNCBN_REQUIRE_DATA=1: the '
         'benchmarks time the cuDNN engine only if they pass' % CUDNN_TESTS, cudnn_tests,
         PYTEST_FIGURES, needs=('gpu', 'cudnn_frontend', 'cudnn'),
         env={'CAFFE_SYNCBN_REQUIRE_DATA': '1'}),
    Step('syncbn', (2,), 40, 'benchmarks/syncbn_gpu.py, 8x256x128x128', syncbn_benchmark,
         [r'^device:', r'^8x256', r'copy bandwidth'], after=syncbn_ratios),
    Step('resnet50', (2,), 75, 'benchmarks/train_gpu.py, ResNet-50 at batch 32: --engine cudnn '
         'TF32 off and on, im2col TF32 off', resnet50_benchmark,
         [r'^net:', r'images/s', r'^ratio', r'^peak GPU', r'^cuDNN engine:', r'skipped'],
         after=resnet50_ratios),
    Step('pspnet', (2,), 130, 'train_gpu.py, PSPNet-50 at 473 with -sync_bn: gpu:0,0 against '
         'gpu:0, then --fit', pspnet_benchmark,
         [r'^net:', r'^devices:', r'images/s', r'^peak GPU', r'^batch norms', r'^free GPU',
          r'^fit '], after=pspnet_ratios),
    Step('efficiency', (2,), 10, 'benchmarks/efficiency.py from the one-replica PSPNet step',
         efficiency, [r'.'], needs=()),
]


def planned(stage=None, only=None):
    """The steps of ``stage`` (1, 2), or those named in ``only``, or all, in their order."""
    return [step for step in STEPS if (stage is None or stage in step.stages) and
            (only is None or step.name in only)]


def plan_lines(steps, stage=None):
    """--dry-run's lines: the stage, each step with its limit, and last the total."""
    lines = ['stage %d: %s' % (stage, STAGES[stage])] if stage else []
    lines += ['%-16s %4d s  %s' % (step.name, step.seconds, step.what) for step in steps]
    return lines + ['total: %d s' % sum(step.seconds for step in steps)]


class Check:
    """One run: where it writes, what the preflight found, each step's result."""

    def __init__(self, out, work, shared, planned):
        self.out, self.work, self.shared, self.planned = out, work, shared, planned
        self.deadline = None             # set by start_budget, once the preflight is done
        self.found, self.missing, self.results, self.outputs = {}, [], [], {}
        self.env = environment()
        self.kernel_cache = os.environ.get('CUPY_CACHE_DIR') or os.path.join(work, 'kernels')

    def start_budget(self, seconds):
        self.deadline = time.monotonic() + seconds

    def say(self, line):
        print('[gpu-check] %s' % line, flush=True)

    def write(self):
        write_report(os.path.join(self.out, 'report.md'), self)


def run_logged(command, env, seconds, log, prefix):
    """Run ``command`` in the source tree, its output (stderr too) streamed to the terminal
    and appended to ``log``; killed with its process group after ``seconds``. (exit
    status or None when killed, the output)."""
    lines = []
    with open(log, 'a') as f:
        f.write('$ %s\n' % shlex.join(command))
        f.flush()
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors='replace',
                                   start_new_session=True)

        def copy():
            for line in process.stdout:
                lines.append(line)
                f.write(line)
                f.flush()
                print('[%s] %s' % (prefix, line.rstrip('\n')), flush=True)
        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        status = None
        try:
            status = process.wait(timeout=max(seconds, 1))
        except subprocess.TimeoutExpired:
            pass
        finally:        # its time is up, or this driver is being stopped (SIGTERM, ^C)
            if status is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)   # its group: pytest's workers too
                except ProcessLookupError:                   # it ended just now
                    pass
                process.wait()
        reader.join(timeout=10)
        if status is None:
            f.write('\n(killed after %.0f s)\n' % seconds)
    return status, ''.join(lines)


def open_section(log, step):
    """Append the step's heading to the run's log: 'steps.log:LINE', where its section starts."""
    with open(log, 'a+') as f:
        f.seek(0)
        line = sum(1 for _ in f) + 1
        f.write('==== %s (limit %d s) ====\n' % (step.name, step.seconds))
    return '%s:%d' % (os.path.basename(log), line)


def run_step(check, step):
    result = {'step': step.name, 'commands': [], 'figures': [], 'log': '-'}
    check.results.append(result)
    log = os.path.join(check.out, LOG)
    start = time.monotonic()
    lacking = [need for need in step.needs if not check.found.get(need)]
    left = check.deadline - time.monotonic()
    try:
        if lacking:
            raise Skip('needs %s (see the preflight)' % ', '.join(lacking))
        if left < 5:
            raise Skip('no time left of --budget')
        commands = step.commands(check)
    except Skip as why:
        result.update(status='skipped', note=str(why), seconds=0.0)
        return result
    except Exception as exc:         # a failed preparation is this step's failure, not the run's
        result.update(status='failed', note='%s: %s' % (type(exc).__name__, exc),
                      seconds=time.monotonic() - start)
        return result
    result['log'] = open_section(log, step)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]),
        CAFFE_SYNCBN_SHARED=check.shared, CUPY_CACHE_DIR=check.kernel_cache,
        PYTHONUNBUFFERED='1', **step.env)
    output, status = '', 0
    for command in commands:         # after a failure too: a benchmark's next run still tells
        result['commands'].append(shlex.join(command))
        left = min(step.seconds - (time.monotonic() - start), check.deadline - time.monotonic())
        returned, text = run_logged(command, env, left, log, step.name)
        output += text
        if returned is None:         # killed: the step's time is spent
            status = None
            break
        status = status or returned
    check.outputs[step.name] = output
    result['figures'] = [line for line in output.splitlines()
                         if any(re.search(p, line) for p in step.figures)]
    result['seconds'] = time.monotonic() - start
    if status is None:
        result.update(status='failed', note='killed after %.0f s (its time limit)'
                      % result['seconds'])
    elif status:
        result.update(status='failed', note='exit status %d' % status)
    else:
        result['status'] = 'passed'
        if step.after:
            passed, note, details = step.after(check)
            result.update(status='passed' if passed else 'failed', note=note, details=details)
    return result


def default_out():
    return os.environ.get('OUT') or os.path.join(ROOT, 'out', 'gpu')


def parse(argv):
    names = [step.name for step in STEPS]
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--out', default=default_out(), help='report folder ($OUT, else out/gpu)')
    chosen = p.add_mutually_exclusive_group()
    chosen.add_argument('--stage', type=int, choices=sorted(STAGES),
                        help='the steps of one stage: %s' % '; '.join(
                            '%d, %s' % item for item in STAGES.items()))
    chosen.add_argument('--only', help='steps to run, separated by commas: preflight, ' +
                        ', '.join(names))
    p.add_argument('--dry-run', action='store_true',
                   help='print the planned steps, their time limits and the total; run nothing')
    p.add_argument('--budget', type=float,
                   help="seconds for all steps, counted from the first (the steps' limits "
                   'added up)')
    p.add_argument('--commit', help='the commit to name in the report (default: git)')
    args = p.parse_args(argv)
    args.only = args.only and [n for n in args.only.split(',') if n != 'preflight']
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        p.error('unknown step %r (known: preflight, %s)' % (unknown[0], ', '.join(names)))
    return args


def main(argv=None):
    args = parse(argv)
    steps = planned(args.stage, args.only)
    if args.dry_run:
        print('\n'.join(plan_lines(steps, args.stage)))
        return 0
    os.makedirs(args.out, exist_ok=True)
    # stopped from outside: the finally clauses end the running step's processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = tempfile.mkdtemp(prefix='gpu-check-')
    check = Check(os.path.abspath(args.out), work, shared_folder(), [s.name for s in steps])
    open(os.path.join(check.out, LOG), 'w').close()
    try:
        preflight(check, commit=args.commit, pspnet=os.path.join(check.shared, PSPNET))
        for line in check.missing:
            check.say('missing: %s' % line)
        check.write()
        check.start_budget(args.budget or sum(step.seconds for step in steps))
        for step in steps:
            check.say('%s: starting' % step.name)
            result = run_step(check, step)
            check.say('%s: %s in %.0f s%s' % (step.name, result['status'], result['seconds'],
                                             ' (%s)' % result['note'] if result.get('note')
                                             else ''))
            check.write()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in check.results:
        check.say('%-16s %-8s %5.0f s  %s' % (r['step'], r['status'], r['seconds'],
                                              r.get('note', '')))
    check.say(verdict(check).replace('**', ''))
    check.say('report: %s' % os.path.join(check.out, 'report.md'))
    failed = check.missing or any(r['status'] != 'passed' for r in check.results)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
