#!/usr/bin/env python3
"""`make gpu-check`: every check that needs a GPU, in one command of at most 10 minutes, with
a markdown report.

    PYTHONPATH=. python3 tools/gpu_check.py [--out DIR] [--only STEP,...] [--budget 570]

Steps, the most important first, each a process of its own with its own time limit (cut
to what is left of --budget): the GPU tests with the goldens; the demo net trained with
-sync_bn on the CPU (cpu:2) and on gpu:0,0, loss for loss; the SyncBN kernel, ResNet-50 and
PSPNet-50 benchmarks; the expected efficiency on 8 and 16 GPUs from the measured step.
A preflight first writes one line per missing thing (CuPy, a device, NCCL, the goldens of
CAFFE_SYNCBN_SHARED, ...); the steps that cannot run without it are skipped, the others run.

The report goes to $OUT when set, else out/gpu/: report.md, rewritten after every step (a
killed run still leaves one), and one log per step, all in one flat folder. The exit
status is 0 only when nothing was missing and every step passed. --only picks steps
(preflight always runs): on a machine without a GPU, --only train-reference runs the CPU
half of the training comparison.
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

from gpu_check_report import environment, preflight, write_report  # noqa: E402
from gpu_check_training import (ITERATIONS, compare_runs,  # noqa: E402
                                prepare_training, train_command)

PYTHON = sys.executable
PSPNET = os.path.join('corpus', 'hszhao_PSPNet__evaluation_prototxt_pspnet50_ADE20K_473.prototxt')


class Step:
    """One step: ``commands(check)`` gives its argv lists (or raises Skip), ``figures`` the
    patterns of the output lines that go into the report, ``needs`` what the preflight must
    have found."""

    def __init__(self, name, seconds, commands, figures, needs=('gpu',), env=None, after=None):
        self.name, self.seconds, self.commands, self.figures = name, seconds, commands, figures
        self.needs, self.env, self.after = needs, env or {}, after


class Skip(Exception):
    """A step that cannot run: its message goes into the report."""


def gpu_tests(check):
    workers = ['-n', '4'] if check.found.get('xdist') else []
    limit = ['--timeout=300'] if check.found.get('timeout') else []
    return [[PYTHON, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-m', 'gpu'] + limit +
            workers + ['tests/gpu']]


def train(devices):
    def commands(check):
        prepare_training(check.work, check.say)
        return [train_command(PYTHON, check.work, devices)]
    return commands


def syncbn_benchmark(check):
    return [[PYTHON, 'benchmarks/syncbn_gpu.py', '--shapes', '8x256x128x128', '--repeats', '5']]


def resnet50_benchmark(check):
    command = [PYTHON, 'benchmarks/train_gpu.py', '--devices', 'gpu:0', '--batch', '32',
               '--warmup', '2', '--iters', '5']
    return [command, command + ['--tf32']]


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
    """The resnet50 step's note: ours / torch in images/s, TF32 off and on."""
    ratios = re.findall(r'^ratio \(ours / torch\): ([\d.]+)x', check.outputs.get('resnet50', ''),
                        re.M)
    return True, 'ours / torch: %s (TF32 off, on)' % ', '.join(r + 'x' for r in ratios) \
        if ratios else 'no ratios: torch was skipped or a run failed', None


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


STEPS = [
    Step('gpu-tests', 240, gpu_tests,
         [r'\d+ (passed|failed|error)', r'^(FAILED|ERROR|SKIPPED) '],
         env={'CAFFE_SYNCBN_REQUIRE_DATA': '1'}),
    Step('train-reference', 45, train('cpu'), [r'Iteration %d, loss' % ITERATIONS],
         needs=('cv2',)),
    Step('train-gpu', 75, train('gpu'), [r'Iteration %d, loss' % ITERATIONS],
         needs=('gpu', 'cv2'), after=compare_runs),
    Step('syncbn', 50, syncbn_benchmark, [r'^device:', r'^8x256', r'copy bandwidth'],
         after=syncbn_ratios),
    Step('resnet50', 90, resnet50_benchmark,
         [r'^net:', r'images/s', r'^ratio', r'^peak GPU', r'skipped'], after=resnet50_ratios),
    Step('pspnet', 120, pspnet_benchmark,
         [r'^net:', r'^devices:', r'images/s', r'^peak GPU', r'^batch norms', r'^free GPU',
          r'^fit '], after=pspnet_ratios),
    Step('efficiency', 15, efficiency, [r'.'], needs=()),
]


class Check:
    """One run: where it writes, what the preflight found, each step's result."""

    def __init__(self, out, work, shared, budget):
        self.out, self.work, self.shared = out, work, shared
        self.deadline = time.monotonic() + budget
        self.found, self.missing, self.results, self.outputs = {}, [], [], {}
        self.env = environment()

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


def run_step(check, step):
    result = {'step': step.name, 'commands': [], 'figures': [], 'log': step.name + '.log'}
    check.results.append(result)
    log = os.path.join(check.out, result['log'])
    start = time.monotonic()
    lacking = [need for need in step.needs if not check.found.get(need)]
    left = check.deadline - time.monotonic()
    try:
        if lacking:
            raise Skip('needs %s (see the preflight)' % ', '.join(lacking))
        if left < 5:
            raise Skip('no time left of --budget')
        commands = step.commands(check)
        open(log, 'w').close()
    except Skip as why:
        result.update(status='skipped', note=str(why), seconds=0.0, log='-')
        return result
    except Exception as exc:         # a failed preparation is this step's failure, not the run's
        result.update(status='failed', note='%s: %s' % (type(exc).__name__, exc),
                      seconds=time.monotonic() - start, log='-')
        return result
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]),
        CAFFE_SYNCBN_SHARED=check.shared, PYTHONUNBUFFERED='1', **step.env)
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


def main(argv=None):
    names = [step.name for step in STEPS]
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--out', default=default_out(), help='report folder ($OUT, else out/gpu)')
    p.add_argument('--only', help='steps to run, separated by commas: preflight, ' +
                   ', '.join(names))
    p.add_argument('--budget', type=float, default=570, help='seconds for all steps (570)')
    p.add_argument('--commit', help='the commit to name in the report (default: git)')
    args = p.parse_args(argv)
    chosen = names if not args.only else [n for n in args.only.split(',') if n != 'preflight']
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        p.error('unknown step %r (known: preflight, %s)' % (unknown[0], ', '.join(names)))
    os.makedirs(args.out, exist_ok=True)
    # stopped from outside: the finally clauses end the running step's processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    shared = os.environ.get('CAFFE_SYNCBN_SHARED', os.path.join(os.path.dirname(ROOT), 'shared'))
    work = tempfile.mkdtemp(prefix='gpu-check-')
    check = Check(os.path.abspath(args.out), work, os.path.abspath(shared), args.budget)
    try:
        preflight(check, commit=args.commit, pspnet=os.path.join(check.shared, PSPNET))
        for line in check.missing:
            check.say('missing: %s' % line)
        check.write()
        for step in STEPS:
            if step.name in chosen:
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
    check.say('report: %s' % os.path.join(check.out, 'report.md'))
    failed = check.missing or any(r['status'] != 'passed' for r in check.results)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
