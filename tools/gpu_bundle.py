#!/usr/bin/env python3
"""`make gpu-bundle`: what a GPU machine lacks, in one git-ignored folder of the checkout that
travels with it, and what to send and run there (docs/gpu.md, "Fifteen minutes of GPU time").

    python3 tools/gpu_bundle.py [--from SHARED] [--wheel NAME==VERSION ...] [--limit-mib 60]

.gpu-bundle/ gets copies of SHARED/golden and SHARED/corpus (SHARED: --from, else
$CAFFE_SYNCBN_SHARED, else ../shared), the folder the GPU tests and benchmarks read their
goldens and prototxts from there, and wheels/: the wheels of WHEELS and --wheel for CPython
3.12 on manylinux x86-64, which tools/gpu_check.py installs before its preflight where the
machine lacks them. The new bundle is made beside the old one and takes its place only when
the checkout's files that travel and the bundle together stay under --limit-mib; then the
tool prints, for each stage of tools/gpu_check.py, the folders to carry, the time limit and
the command of one device call.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'tools'))

from gpu_check import PSPNET, STAGES, planned  # noqa: E402
from gpu_check_report import BUNDLE, git_commit  # noqa: E402

#: wheels the GPU machine may lack, as pip pins (NAME==VERSION); the preflight installs those
#: it does lack. The cuDNN engine's frontend (`import cudnn`), which imports cuda.bindings on
#: some paths (the current device), which needs cuda-pathfinder. The frontend's other declared
#: dependencies, nvidia-cutlass-dsl (about 180 MB) and apache-tvm-ffi, serve only its opt-in
#: JIT engines and stay behind: the wheels travel without their dependencies.
WHEELS = ('nvidia-cudnn-frontend==1.32.0', 'cuda-bindings==13.5.0', 'cuda-pathfinder==1.9.1')
PLATFORMS = ('manylinux_2_28_x86_64', 'manylinux_2_27_x86_64', 'manylinux_2_17_x86_64',
             'manylinux2014_x86_64', 'manylinux1_x86_64')
#: the device tools take 64 MiB: the rest is room for what a session adds beside
LIMIT_MIB = 60
#: seconds a device call adds to its stage's planned steps: the machine imports CuPy and
#: torch for the preflight, and writes the dataset of the training steps
PREFLIGHT_S = 30
MIB = 2 ** 20


class BundleError(Exception):
    """One line that says what is wrong and what to do."""


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(folder, name))
               for folder, _, names in os.walk(path) for name in names)


def checkout_bytes():
    """Bytes of the checkout's files that travel: tracked, and untracked but not ignored."""
    try:
        listed = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others',
                                 '--exclude-standard'], cwd=ROOT, capture_output=True,
                                timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BundleError('cannot list the files of %s with git: %s' % (ROOT, exc)) from None
    if listed.returncode:
        raise BundleError('%s is not a git checkout: the device tools send a checkout'
                          % ROOT)
    paths = [os.path.join(ROOT, name) for name in listed.stdout.decode().split('\0') if name]
    return sum(os.lstat(path).st_size for path in paths if os.path.lexists(path))


def copy_files(source, target):
    """The files of ``source`` into ``target``, without their permissions: ../shared may be
    read-only, and the bundle is replaced by the next one."""
    for folder, _, names in os.walk(source, followlinks=True):
        into = os.path.join(target, os.path.relpath(folder, source))
        os.makedirs(into, exist_ok=True)
        for name in names:
            shutil.copyfile(os.path.join(folder, name), os.path.join(into, name))


def download_wheels(specs, folder):
    os.makedirs(folder)
    for spec in specs:
        command = [sys.executable, '-m', 'pip', 'download', '-q', '--no-deps',
                   '--only-binary=:all:', '--python-version', '3.12', '--implementation', 'cp',
                   '-d', folder, spec]
        for platform in PLATFORMS:
            command[-1:-1] = ['--platform', platform]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            why = (result.stderr.strip() or 'exit status %d' % result.returncode).splitlines()
            raise BundleError('pip download %s failed: %s' % (spec, why[-1]))


def make_bundle(shared, wheels, limit_mib):
    """Fill a new bundle beside BUNDLE from ``shared``, and swap it in if what travels stays
    under ``limit_mib``. {'golden': files, 'corpus': files, 'wheels': names, 'bytes': bundle,
    'travels': bundle and checkout}."""
    shared = os.path.abspath(shared)
    if os.path.realpath(shared) == os.path.realpath(BUNDLE):
        raise BundleError('the source %s is the bundle itself: point --from or '
                          'CAFFE_SYNCBN_SHARED at ../shared' % shared)
    for needed in ('golden/index.json', PSPNET):
        if not os.path.isfile(os.path.join(shared, needed)):
            raise BundleError('%s not found: point --from or CAFFE_SYNCBN_SHARED at a copy of '
                              '../shared (goldens and corpus)' % os.path.join(shared, needed))
    new, old = BUNDLE + '.new', BUNDLE + '.old'
    for leftover in (new, old):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        for name in ('golden', 'corpus'):
            copy_files(os.path.join(shared, name), os.path.join(new, name))
        download_wheels(wheels, os.path.join(new, 'wheels'))
        made = {name: len(os.listdir(os.path.join(new, name))) for name in ('golden', 'corpus')}
        made.update(wheels=sorted(os.listdir(os.path.join(new, 'wheels'))),
                    bytes=folder_bytes(new), source=shared,
                    made=time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()))
        made['travels'] = made['bytes'] + checkout_bytes()
        if made['travels'] > limit_mib * MIB:
            raise BundleError('%.1f MiB would travel (the checkout %.1f MiB, the bundle %.1f '
                              'MiB), over the limit of %d MiB: the bundle is not made' % (
                                  made['travels'] / MIB, (made['travels'] - made['bytes']) / MIB,
                                  made['bytes'] / MIB, limit_mib))
        with open(os.path.join(new, 'bundle.json'), 'w') as f:
            json.dump(made, f, indent=1)
        if os.path.isdir(BUNDLE):
            os.rename(BUNDLE, old)
        os.rename(new, BUNDLE)
    finally:
        for leftover in (new, old):
            shutil.rmtree(leftover, ignore_errors=True)
    return made


def device_calls(commit):
    """Per stage: (its line, the device call's timeout_s, its command)."""
    calls = []
    for stage, what in sorted(STAGES.items()):
        seconds = sum(step.seconds for step in planned(stage))
        command = 'PYTHONUNBUFFERED=1 PYTHONPATH=. python3 tools/gpu_check.py --stage %d' % stage
        if commit:
            command += ' --commit %s' % shlex.quote(commit)
        calls.append(('stage %d, %s (%d s of steps)' % (stage, what, seconds),
                      seconds + PREFLIGHT_S, command))
    return calls


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--from', dest='shared', default=os.environ.get(
        'CAFFE_SYNCBN_SHARED', os.path.join(os.path.dirname(ROOT), 'shared')),
        help='the folder of golden/ and corpus/ ($CAFFE_SYNCBN_SHARED, else ../shared)')
    p.add_argument('--wheel', action='append', default=[], metavar='NAME==VERSION',
                   help='a wheel the GPU machine lacks, besides WHEELS (%s)'
                   % (', '.join(WHEELS) or 'none'))
    p.add_argument('--limit-mib', type=float, default=LIMIT_MIB,
                   help='the most that may travel, checkout and bundle (%(default)s MiB)')
    args = p.parse_args(argv)
    try:
        made = make_bundle(args.shared, list(WHEELS) + args.wheel, args.limit_mib)
    except (BundleError, OSError) as exc:
        print('gpu-bundle: %s' % exc, file=sys.stderr)
        return 1
    name = os.path.relpath(BUNDLE, ROOT)
    print('gpu-bundle: %s/ holds golden (%d files), corpus (%d files) and wheels (%s): %.1f MiB '
          'from %s' % (name, made['golden'], made['corpus'], ', '.join(made['wheels']) or 'none',
                       made['bytes'] / MIB, made['source']))
    print('gpu-bundle: %.1f MiB travel with the checkout, of %g MiB' % (made['travels'] / MIB,
                                                                       args.limit_mib))
    for line, timeout, command in device_calls(git_commit()):
        print('%s:\n  carry: %s\n  timeout_s: %d\n  command: %s' % (
            line, json.dumps([name]), timeout, command))
    return 0


if __name__ == '__main__':
    sys.exit(main())
