#!/usr/bin/env python3
"""Forward, backward and per-layer times of a net, like `caffe time`, and against Caffe.

    python benchmarks/net_time.py PROTOTXT [--batch N] [--iterations K] [--threads T]
    python benchmarks/net_time.py PROTOTXT --batch N --compare-caffe PATH/TO/caffe [--pairs P]
    python benchmarks/net_time.py PROTOTXT --batch N --compare-winograd [on] [--pairs P]

Data layers become Input layers, every Input's first axis becomes --batch, backward is
forced (unless --forward-only), weights come from the prototxt's fillers
(timing.timing_net_param). The means
over --iterations passes after one warm-up pass are printed per layer and in total,
with this process's peak memory (VmHWM).

--compare-caffe times BVLC Caffe's `caffe time` on the very same prototxt (TRAIN,
forward+backward) and ours, each in a fresh process, in --pairs alternating pairs
(ours first in even pairs, Caffe first in odd ones), both with --threads BLAS threads
(OPENBLAS_NUM_THREADS, default 2: numpy's OpenBLAS and the one Caffe links read it).
It prints every pair, the medians and the ratios ours / Caffe of the forward-backward
time and of the peak resident memory (ru_maxrss of each process, taken alike), then
where the time goes by layer type, and the load average before and after.

--compare-winograd times ours with Winograd's 3x3 convolutions where its rule picks
them (CAFFE_SYNCBN_WINOGRAD=auto; --compare-winograd on: wherever it applies) and
without (off): --pairs alternating pairs of
--iterations passes each on one net in this process, so that both see the same load, and
the peak memory of one fresh process each; it prints the same table and the ratios
with / without.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn.memory_planner import DEFAULT_PLAN, MEMORY_PLANS  # noqa: E402


def time_ours(args):
    from caffe_syncbn import TEST, TRAIN, Net
    from caffe_syncbn.analysis.timing import (format_timings, peak_memory_kb, time_net,
                                              timing_net_param)
    net = Net(timing_net_param(args.model, args.batch, force_backward=not args.forward_only),
              TRAIN if args.phase == 'TRAIN' else TEST, memory_plan=args.memory_plan)
    result = time_net(net, args.iterations, backward=not args.forward_only)
    types = {name: layer.type for name, layer in zip(net._layer_names, net.layers)}
    if args.json:
        print(json.dumps({'forward_ms': result['forward_total'] * 1e3,
                          'backward_ms': result['backward_total'] * 1e3,
                          'total_ms': result['total'] * 1e3, 'peak_kb': peak_memory_kb(),
                          'types': types,
                          'layers': {name: (f + b) * 1e3 for (name, f), (_, b) in
                                     zip(result['forward'], result['backward'])}}))
        return 0
    for line in format_timings(result, types):
        print(line)
    print('Peak memory: %.1f MiB (VmHWM)' % (peak_memory_kb() / 1024.0))
    return 0


def compare_with_caffe(args):
    runs, ours, caffe = compare_runs(args.compare_caffe, args.model, args.batch,
                                     args.iterations, args.pairs, args.threads, args.memory_plan)
    for part in ('forward', 'backward'):
        a, b = ours[part + '_ms'], caffe[part + '_ms']
        print('  %-8s ours %.1f ms, Caffe %.1f ms (%.3fx)' % (part, a, b, a / b))
    print_by_type(runs)
    print('RATIO time %.3f memory %.3f (ours / Caffe, medians of %d pairs); load average '
          'after %.2f %.2f %.2f' % (ours['total_ms'] / caffe['total_ms'],
                                    ours['peak_kb'] / caffe['peak_kb'], args.pairs,
                                    *os.getloadavg()))
    return 0


def compare_runs(caffe_binary, model, batch, iterations, pairs, threads, memory_plan):
    """Time ``model`` with `caffe time` and with ours in ``pairs`` alternating pairs of
    fresh processes, printing each pair and the medians; return (the runs {'ours': [...],
    'caffe': [...]}, our medians, Caffe's medians), the medians of forward_ms,
    backward_ms, total_ms and peak_kb."""
    from caffe_reference import (blas_env, caffe_time, run_measured, temporary_folder,
                                 write_timing_prototxt)
    env = blas_env(threads)
    runs = {'ours': [], 'caffe': []}
    with temporary_folder() as folder:
        prototxt = write_timing_prototxt(model, batch, folder)
        ours_command = [sys.executable, os.path.abspath(__file__), prototxt, '--json',
                        '--iterations', str(iterations), '--memory-plan', memory_plan]
        print('%s, batch %s, TRAIN forward+backward, %d iterations per run, %d BLAS '
              'thread(s) each, OPENBLAS_CORETYPE=%s; load average %.2f %.2f %.2f'
              % (model, batch or "the prototxt's", iterations, threads,
                 env['OPENBLAS_CORETYPE'] or '(unset)', *os.getloadavg()))
        print('  pair ours ms  Caffe ms  ratio   ours MiB  Caffe MiB  ratio')
        for pair in range(pairs):
            order = ('ours', 'caffe') if pair % 2 == 0 else ('caffe', 'ours')
            for who in order:
                if who == 'ours':
                    stdout, _, peak = run_measured(ours_command, env)
                    result = json.loads(stdout.strip().splitlines()[-1])
                    result['peak_kb'] = peak
                else:
                    result = caffe_time(caffe_binary, prototxt, iterations, env)
                runs[who].append(result)
            print(_row(str(pair), runs['ours'][-1], runs['caffe'][-1]))
    median = {who: {key: statistics.median(r[key] for r in results)
                    for key in ('forward_ms', 'backward_ms', 'total_ms', 'peak_kb')}
              for who, results in runs.items()}
    print(_row('median', median['ours'], median['caffe']))
    print("  Caffe's OpenBLAS ran its %s kernels" % ', '.join(sorted(
        {r['blas_core'] for r in runs['caffe']})))
    return runs, median['ours'], median['caffe']


def compare_winograd(args):
    """Ours with Winograd (CAFFE_SYNCBN_WINOGRAD=args.compare_winograd: 'auto' or 'on';
    the runs under 'ours') against ours without ('off', under 'caffe'):
    times in this process, on one net, the two alternating (CAFFE_SYNCBN_WINOGRAD is read
    at every pass), so that both see the same load; the peak memory of one fresh process
    each."""
    from caffe_reference import blas_env, run_measured
    from caffe_syncbn import TEST, TRAIN, Net
    from caffe_syncbn.analysis.timing import time_net, timing_net_param
    from caffe_syncbn.layers.conv import host_winograd as winograd_cpu
    print('%s, batch %s, %s, %d iterations per run, %d thread(s); load average %.2f %.2f '
          '%.2f' % (args.model, args.batch or "the prototxt's", args.phase, args.iterations,
                    args.threads, *os.getloadavg()))
    command = [sys.executable, os.path.abspath(__file__), args.model, '--json',
               '--iterations', '1', '--phase', args.phase]
    command += ['--batch', str(args.batch)] if args.batch else []
    command += ['--forward-only'] if args.forward_only else []
    peaks = {}
    with_mode = args.compare_winograd
    for mode in (with_mode, 'off'):
        env = blas_env(args.threads)
        env[winograd_cpu.MODE_VARIABLE] = mode
        peaks[mode] = run_measured(command, env)[2]
    net = Net(timing_net_param(args.model, args.batch, force_backward=not args.forward_only),
              TRAIN if args.phase == 'TRAIN' else TEST)
    types = {name: layer.type for name, layer in zip(net._layer_names, net.layers)}
    print('  pair  with ms  without ms ratio  with MiB without MiB ratio')
    runs = {'ours': [], 'caffe': []}
    for pair in range(args.pairs):
        for mode in (with_mode, 'off') if pair % 2 == 0 else ('off', with_mode):
            os.environ[winograd_cpu.MODE_VARIABLE] = mode
            result = time_net(net, args.iterations, backward=not args.forward_only)
            runs['ours' if mode == with_mode else 'caffe'].append({
                'forward_ms': result['forward_total'] * 1e3,
                'backward_ms': result['backward_total'] * 1e3,
                'total_ms': result['total'] * 1e3, 'peak_kb': peaks[mode], 'types': types,
                'layers': {name: (f + b) * 1e3 for (name, f), (_, b) in
                           zip(result['forward'], result['backward'])}})
        print(_row(str(pair), runs['ours'][-1], runs['caffe'][-1]))
    median = {who: {key: statistics.median(r[key] for r in results)
                    for key in ('forward_ms', 'backward_ms', 'total_ms', 'peak_kb')}
              for who, results in runs.items()}
    print(_row('median', median['ours'], median['caffe']))
    for part in ('forward', 'backward'):
        a, b = median['ours'][part + '_ms'], median['caffe'][part + '_ms']
        print('  %-8s with %.1f ms, without %.1f ms (%.3fx)' % (part, a, b, a / b if b else 0))
    print_by_type(runs, ('with', 'without'))
    print('RATIO time %.3f memory %.3f (with Winograd %s / without, medians of %d pairs); '
          'load average after %.2f %.2f %.2f' % (
              median['ours']['total_ms'] / median['caffe']['total_ms'],
              median['ours']['peak_kb'] / median['caffe']['peak_kb'], with_mode, args.pairs,
              *os.getloadavg()))
    return 0


def _row(label, ours, caffe):
    return '%6s %7.1f %9.1f %6.3f %10.1f %10.1f %6.3f' % (
        label, ours['total_ms'], caffe['total_ms'], ours['total_ms'] / caffe['total_ms'],
        ours['peak_kb'] / 1024, caffe['peak_kb'] / 1024, ours['peak_kb'] / caffe['peak_kb'])


def print_by_type(runs, names=('ours', 'Caffe')):
    """Forward+backward ms per layer type (median over runs), ours against Caffe's (or
    the two runs that ``names`` name)."""
    types = runs['ours'][0]['types']

    def by_type(result):
        sums = {}
        for name, ms in result['layers'].items():
            kind = types.get(name, '?')
            sums[kind] = sums.get(kind, 0.0) + ms
        return sums

    ours = [by_type(r) for r in runs['ours']]
    caffe = [by_type(r) for r in runs['caffe']]
    kinds = sorted(set(ours[0]) | set(caffe[0]), key=lambda k: -ours[0].get(k, 0.0))
    print('by layer type (forward+backward, median ms): %7s %7s   ratio' % names)
    for kind in kinds:
        a = statistics.median(r.get(kind, 0.0) for r in ours)
        b = statistics.median(r.get(kind, 0.0) for r in caffe)
        print('  %-24s %8.2f %8.2f %7s' % (kind, a, b, '%.3f' % (a / b) if b > 0.005 else '-'))


def add_memory_plan_flag(parser):
    parser.add_argument('--memory-plan', default=DEFAULT_PLAN['command'], choices=MEMORY_PLANS,
                        help="our Net's memory plan (default %s, as caffe-syncbn time)"
                        % DEFAULT_PLAN['command'])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('model', help='net prototxt')
    parser.add_argument('--batch', type=int, default=None,
                        help="batch size of every input (default: the prototxt's)")
    parser.add_argument('--iterations', type=int, default=10)
    parser.add_argument('--phase', choices=['TRAIN', 'TEST'], default='TRAIN')
    parser.add_argument('--forward-only', action='store_true', help='time the forward pass only')
    parser.add_argument('--threads', type=int, default=None,
                        help='BLAS threads (default: as the environment says; with '
                             '--compare-caffe, 2)')
    parser.add_argument('--compare-caffe', metavar='CAFFE', help='path of the caffe binary')
    parser.add_argument('--compare-winograd', nargs='?', const='auto', choices=['auto', 'on'],
                        help='with Winograd (by its rule, or on: wherever it applies) '
                             'against without')
    parser.add_argument('--pairs', type=int, default=3, help='alternating pairs (default 3)')
    add_memory_plan_flag(parser)
    parser.add_argument('--json', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.pairs < 1:
        parser.error('--iterations and --pairs must be at least 1')
    if args.compare_caffe:
        if args.phase != 'TRAIN' or args.forward_only:
            parser.error('--compare-caffe times the TRAIN forward+backward, as caffe time does')
        if not os.access(args.compare_caffe, os.X_OK):
            parser.error('%s is not an executable caffe binary' % args.compare_caffe)
        args.threads = args.threads or 2
    elif args.compare_winograd:
        args.threads = args.threads or 2
    if args.threads and not args.compare_caffe:
        for name in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS'):
            os.environ[name] = str(args.threads)      # before numpy loads its BLAS
    from caffe_syncbn.cli.common import run_main  # imports numpy
    if args.compare_caffe:
        run_main(lambda: compare_with_caffe(args))
    elif args.compare_winograd:
        run_main(lambda: compare_winograd(args))
    else:
        run_main(lambda: time_ours(args))


if __name__ == '__main__':
    main()
