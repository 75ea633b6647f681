#!/usr/bin/env python3
"""Peak memory of TRAIN steps of a net (forward + backward), and where it goes, per memory plan.

    python benchmarks/memory.py PROTOTXT [--batch N] [--steps 2] [--memory-plan PLAN]
    python benchmarks/memory.py PROTOTXT --batch N --memory-plan all [--compare-caffe CAFFE]
    python benchmarks/memory.py PROTOTXT --memory-plan all --max-batch-in 8G
    python benchmarks/memory.py PROTOTXT --batch N --precision float32,float16,bfloat16

The net is built as net_time.py builds it (timing.timing_net_param: Input layers of
--batch, backward forced, weights from the fillers). With one plan and nothing to
compare, this process prints its peak resident memory (VmHWM) after the imports, after
building the net, and after each step; then what the blobs hold (data and diff of
activations and of params) and the arrays that layers keep from the forward for the
backward, largest first.

With several plans (--memory-plan off,share or all) or --compare-caffe, each plan runs
this script in its own process, and Caffe runs `caffe time -iterations 1` (a warm-up step
and one timed step: 2 steps) on the same prototxt, --pairs times in rotating order. It
prints, per plan, the median peak resident memory (ru_maxrss, taken alike for all), its
ratio to 'off' and to Caffe, and the median time of a step (the last of --steps) as a
ratio to 'off', measured in the same runs.

--max-batch-in BUDGET (e.g. 8G, 512M) finds, per plan, the largest batch whose peak
resident memory over one step stays within BUDGET: doubling, then bisection, each probe
a process of its own.

--precision runs the net in each precision given (float32, or mixed precision: float16
or bfloat16 activations and diffs, float32 params), each a process of its own per plan, as
several plans do; with --per-image it measures batches N and 2N and prints the memory per
image (the difference over N) of each, and its ratio to float32's.

--step-rounds N times the plans in one process instead: a net per plan, a warm-up step
each, then N rounds of one step of each net, in alternating order; it prints the median
step of each plan as a ratio to the first plan's (the step times of the other modes come
from single steps of separate processes, which the first steps' allocations weigh on).
"""
import argparse
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

MIB = 1024.0 * 1024.0


def _stored(blob):
    """The arrays a blob holds (its diff only once made: asking for it would make it)."""
    return [blob.data] + ([blob.diff_if_made] if blob.diff_if_made is not None else [])


def kept_arrays(layer, xp, blob_memory):
    """{attribute: bytes} of the arrays a layer holds that are no blob's memory (its
    caches), each array counted once."""
    from caffe_syncbn.blob import storage_of
    kept, seen = {}, set(blob_memory)
    for name, value in vars(layer).items():
        values = value.values() if isinstance(value, dict) else \
            value if isinstance(value, (list, tuple)) else [value]
        size = 0
        for base in (storage_of(v) for v in values if isinstance(v, xp.ndarray)):
            if id(base) not in seen:
                seen.add(id(base))
                size += base.nbytes
        if size:
            kept[name] = size
    return kept


def measure_ours(args):
    from caffe_syncbn.analysis.timing import peak_memory_kb
    print('after imports:        peak %7.1f MiB' % (peak_memory_kb() / 1024.0))
    from caffe_reference import as_training

    from caffe_syncbn import TRAIN, Net
    from caffe_syncbn.blob import storage_of
    from caffe_syncbn.analysis.timing import timing_net_param
    param = with_input_size(timing_net_param(args.model, args.batch), args.input_size)
    net = Net(as_training(param) if args.as_training else param, TRAIN,
              memory_plan=args.memory_plan[0], precision=args.precision[0])
    print('after building:       peak %7.1f MiB' % (peak_memory_kb() / 1024.0))
    for step in range(args.steps):
        start = time.perf_counter()
        net.forward_prefilled()
        if step == args.steps - 1:
            plan = net.planner.plan
            blob_memory = {id(storage_of(array)) for b in list(net.blobs.values())
                           + net.learnable_params for array in _stored(b)}
            blob_memory |= {id(plan.arena)} if plan else set()
            caches = [(layer_name, attr, size) for layer_name, layer in
                      zip(net._layer_names, net.layers)
                      for attr, size in kept_arrays(layer, net.context.xp, blob_memory).items()]
        net.backward_from()
        seconds = time.perf_counter() - start
        print('after step %d:         peak %7.1f MiB' % (step + 1, peak_memory_kb() / 1024.0))
    params = {id(b): b for b in net.learnable_params}
    activations = {id(b): b for b in net.blobs.values()}

    def held(blobs, field):
        arrays = (blob.data if field == 'data' else blob.diff_if_made for blob in blobs.values())
        bases = {id(b): b.nbytes for b in (storage_of(a) for a in arrays if a is not None)}
        return sum(bases.values()) / MIB

    print('params:      data %7.1f MiB, diff %7.1f MiB'
          % (held(params, 'data'), held(params, 'diff')))
    print('activations: data %7.1f MiB, diff %7.1f MiB%s' % (
        held(activations, 'data'), held(activations, 'diff'),
        ' (the kept blobs), and %.1f MiB in the arena of plan %s' % (
            plan.arena.nbytes / MIB, net.memory_plan) if plan else ''))
    total = sum(size for _, _, size in caches)
    print('kept by layers from forward to backward: %.1f MiB' % (total / MIB))
    for layer_name, attr, size in sorted(caches, key=lambda c: -c[2])[:args.top]:
        print('  %-28s %-18s %7.2f MiB' % (layer_name, attr, size / MIB))
    print('PEAK_KB %d' % peak_memory_kb())
    print('STEP_S %.6f' % seconds)
    return 0


def with_input_size(param, size):
    """``param`` with the height and width of every 4-D Input set to ``size`` (or as it is)."""
    for layer in param.layer if size else ():
        if layer.type == 'Input':
            for shape in layer.input_param.shape:
                if len(shape.dim) == 4:
                    shape.dim[2:] = size
    return param


def _ours(args, prototxt, plan, batch=None, steps=None, precision='float32'):
    """The command that measures one plan in one precision in a process of its own."""
    command = [sys.executable, os.path.abspath(__file__), prototxt, '--memory-plan', plan,
               '--steps', str(steps or args.steps), '--precision', precision]
    if args.input_size:
        command += ['--input-size', ','.join(map(str, args.input_size))]
    return command + (['--batch', str(batch)] if batch else [])    # made for training


def compare_precisions(args):
    """Peak memory of a TRAIN step per plan and precision, medians of --pairs runs in
    rotating order; with --per-image, at batches N and 2N, and the memory per image."""
    from caffe_reference import blas_env, run_measured, temporary_folder, write_timing_prototxt
    env = blas_env(args.threads)
    batch = args.batch or 1
    batches = (batch, 2 * batch) if args.per_image else (batch,)
    runs = {(plan, precision, b): [] for plan in args.memory_plan
            for precision in args.precision for b in batches}
    load = os.getloadavg()
    with temporary_folder() as folder:
        prototxt = write_timing_prototxt(args.model, None, folder, args.as_training)
        for pair in range(args.pairs):
            order = list(runs)
            for plan, precision, b in order[pair % len(order):] + order[:pair % len(order)]:
                _, _, peak = run_measured(_ours(args, prototxt, plan, b, steps=args.steps,
                                                precision=precision), env)
                runs[plan, precision, b].append(peak / 1024.0)
    peak = {key: statistics.median(values) for key, values in runs.items()}
    print('TRAIN steps of %s, %d BLAS thread(s), medians of %d; load average %.2f %.2f %.2f'
          % (os.path.basename(args.model), args.threads, args.pairs, *load))
    print('%-12s %-9s %s%s' % ('plan', 'precision', ' '.join('%13s' % ('peak MiB, N=%d' % b)
                                                             for b in batches),
                             '  %13s %9s' % ('MiB per image', '/ float32') if args.per_image
                             else ''))
    for plan in args.memory_plan:
        per_image = {p: (peak[plan, p, 2 * batch] - peak[plan, p, batch]) / batch
                     for p in args.precision} if args.per_image else {}
        for precision in args.precision:
            line = '%-12s %-9s %s' % (plan, precision, ' '.join(
                '%13.1f' % peak[plan, precision, b] for b in batches))
            if per_image:
                line += '  %13.3f %9s' % (per_image[precision], '%.3f' % (
                    per_image[precision] / per_image['float32']) if 'float32' in per_image else '-')
            print(line)
    return 0


def compare_plans(args):
    from caffe_reference import (blas_env, caffe_time, run_measured, temporary_folder,
                                 write_timing_prototxt)
    env = blas_env(args.threads)
    runs = {plan: [] for plan in args.memory_plan}
    if args.compare_caffe:
        runs['caffe'] = []
    load = os.getloadavg()
    with temporary_folder() as folder:
        prototxt = write_timing_prototxt(args.model, args.batch, folder, args.as_training)
        for pair in range(args.pairs):
            order = list(runs)
            for who in order[pair % len(order):] + order[:pair % len(order)]:
                if who == 'caffe':
                    runs[who].append((caffe_time(args.compare_caffe, prototxt, 1, env)['peak_kb'],
                                      None))
                    continue
                stdout, _, peak = run_measured(_ours(args, prototxt, who), env)
                runs[who].append((peak, float(re.search(r'^STEP_S (\S+)', stdout, re.M).group(1))))
    peak = {who: statistics.median(p for p, _ in r) / 1024.0 for who, r in runs.items()}
    step = {who: statistics.median(t for _, t in r) for who, r in runs.items() if who != 'caffe'}
    print('TRAIN steps of %s, batch %s, %d BLAS thread(s), medians of %d; load average '
          '%.2f %.2f %.2f' % (os.path.basename(args.model), args.batch or "the prototxt's",
                              args.threads, args.pairs, *load))
    print('%-12s %12s %9s %9s %12s' % ('plan', 'peak MiB', '/ off', '/ Caffe', 'step / off'))
    for who in runs:
        print('%-12s %12.1f %9s %9s %12s' % (
            who, peak[who], '%.3f' % (peak[who] / peak['off']) if 'off' in peak else '-',
            '%.3f' % (peak[who] / peak['caffe']) if 'caffe' in peak else '-',
            '%.3f' % (step[who] / step['off']) if who in step and 'off' in step else '-'))
    return 0


def max_batches(args):
    from caffe_reference import blas_env, run_measured, temporary_folder, write_timing_prototxt
    env = blas_env(args.threads)
    with temporary_folder() as folder:
        prototxt = write_timing_prototxt(args.model, None, folder, args.as_training)
        for plan in args.memory_plan:
            def fits(batch):
                _, _, peak = run_measured(_ours(args, prototxt, plan, batch, steps=1), env)
                print('  %s, batch %d: peak %.1f MiB' % (plan, batch, peak / 1024.0), flush=True)
                return peak * 1024 <= args.max_batch_in
            good, bad = 0, 1
            while fits(bad):
                good, bad = bad, bad * 2
            while bad - good > 1:
                middle = (good + bad) // 2
                good, bad = (middle, bad) if fits(middle) else (good, middle)
            print('%s: largest batch within %.1f GiB: %d' % (plan, args.max_batch_in / 2 ** 30, good),
                  flush=True)
    return 0


def alternate_steps(args):
    from caffe_reference import as_training

    from caffe_syncbn import TRAIN, Net
    from caffe_syncbn.analysis.timing import timing_net_param
    param = with_input_size(timing_net_param(args.model, args.batch), args.input_size)
    param = as_training(param) if args.as_training else param
    nets = {plan: Net(param, TRAIN, memory_plan=plan) for plan in args.memory_plan}
    times = {plan: [] for plan in nets}
    load = os.getloadavg()
    for round_index in range(args.step_rounds + 1):
        order = list(nets) if round_index % 2 == 0 else list(nets)[::-1]
        for plan in order:
            start = time.perf_counter()
            nets[plan].forward_prefilled()
            nets[plan].backward_from()
            if round_index:                       # the first round warms up
                times[plan].append(time.perf_counter() - start)
    first = statistics.median(times[args.memory_plan[0]])
    print('TRAIN steps of %s, batch %s, one process, medians of %d alternating rounds; load '
          'average %.2f %.2f %.2f' % (os.path.basename(args.model), args.batch or "the "
                                      "prototxt's", args.step_rounds, *load))
    for plan, steps in times.items():
        print('%-12s %8.3f s %7.3f  (%s)' % (plan, statistics.median(steps),
                                            statistics.median(steps) / first,
                                            ' '.join('%.3f' % t for t in steps)))
    return 0


def byte_count(text):
    units = {'K': 2 ** 10, 'M': 2 ** 20, 'G': 2 ** 30}
    try:
        return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1:].upper() in units \
            else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError('%r is not a size such as 8G or 512M' % text) from None


def plan_list(text):
    from caffe_syncbn.memory_planner import MEMORY_PLANS
    plans = list(MEMORY_PLANS) if text == 'all' else text.split(',')
    unknown = [plan for plan in plans if plan not in MEMORY_PLANS]
    if unknown:
        raise argparse.ArgumentTypeError('unknown memory plan %r (known: %s, all)'
                                         % (unknown[0], ', '.join(MEMORY_PLANS)))
    return plans


def precision_list(text):
    from caffe_syncbn.precision import PRECISIONS
    precisions = text.split(',')
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise argparse.ArgumentTypeError('unknown precision %r (known: %s)'
                                         % (unknown[0], ', '.join(PRECISIONS)))
    return precisions


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('model', help='net prototxt')
    parser.add_argument('--batch', type=int, default=None,
                        help="batch size of every input (default: the prototxt's)")
    parser.add_argument('--steps', type=int, default=2, help='TRAIN steps (default 2)')
    parser.add_argument('--top', type=int, default=12, help='largest layer caches listed')
    parser.add_argument('--threads', type=int, default=2,
                        help='BLAS threads with --compare-caffe (default 2)')
    parser.add_argument('--compare-caffe', metavar='CAFFE', help='path of the caffe binary')
    parser.add_argument('--pairs', type=int, default=3, help='alternating pairs (default 3)')
    parser.add_argument('--memory-plan', type=plan_list, default=['off'], metavar='PLANS',
                        help="the Net's memory plans, separated by ',', or 'all' (default off)")
    parser.add_argument('--input-size', type=lambda text: [int(v) for v in text.split(',')],
                        metavar='H,W', help='the height and width of every 4-D input')
    parser.add_argument('--as-training', action='store_true',
                        help='batch statistics in every batch norm, and a loss where the net '
                             'has none (caffe_reference.as_training)')
    parser.add_argument('--max-batch-in', type=byte_count, metavar='BUDGET',
                        help='the largest batch per plan whose peak stays within BUDGET (8G)')
    parser.add_argument('--step-rounds', type=int, metavar='N',
                        help='time the plans in one process, N alternating rounds')
    parser.add_argument('--precision', type=precision_list, default=['float32'],
                        metavar='PRECISIONS', help="the nets' precisions, separated by ',' "
                        '(float32, float16, bfloat16; default float32)')
    parser.add_argument('--per-image', action='store_true',
                        help='with several precisions: batches N and 2N, and the memory per image')
    args = parser.parse_args(argv)
    if args.steps < 1 or args.pairs < 1:
        parser.error('--steps and --pairs must be at least 1')
    if args.compare_caffe and not os.access(args.compare_caffe, os.X_OK):
        parser.error('%s is not an executable caffe binary' % args.compare_caffe)
    from caffe_syncbn.cli.common import run_main
    if len(args.precision) > 1 or args.per_image:
        run_main(lambda: compare_precisions(args))
    elif args.max_batch_in:
        run_main(lambda: max_batches(args))
    elif args.step_rounds:
        run_main(lambda: alternate_steps(args))
    elif args.compare_caffe or len(args.memory_plan) > 1:
        run_main(lambda: compare_plans(args))
    else:
        run_main(lambda: measure_ours(args))


if __name__ == '__main__':
    main()
