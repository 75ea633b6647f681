#!/usr/bin/env python3
"""Peak memory of TRAIN steps of a net (forward + backward), and where it goes.

    python benchmarks/memory.py PROTOTXT [--batch N] [--steps 2]
    python benchmarks/memory.py PROTOTXT --batch N --compare-caffe PATH/TO/caffe [--pairs 3]

The net is built as net_time.py builds it (timing.timing_net_param: Input layers of
--batch, backward forced, weights from the fillers) in this fresh process, which prints
its peak resident memory (VmHWM) after the imports, after building the net, and after
each step; then what the blobs hold (data and diff of activations and of params) and the
arrays that layers keep from the forward for the backward, largest first.

--compare-caffe runs this script and `caffe time -iterations 1` (a warm-up step and one
timed step: 2 steps) on the same prototxt, each in its own process, --pairs times,
alternating, and prints the peak resident memory of both (ru_maxrss, taken alike) and
the ratio ours / Caffe of the medians.
"""
import argparse
import os
import statistics
import sys

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
    from caffe_syncbn.cli.timing import peak_memory_kb
    print('after imports:        peak %7.1f MiB' % (peak_memory_kb() / 1024.0))
    from caffe_syncbn import TRAIN, Net
    from caffe_syncbn.blob import storage_of
    from caffe_syncbn.cli.timing import timing_net_param
    net = Net(timing_net_param(args.model, args.batch), TRAIN, memory_plan=args.memory_plan[0])
    print('after building:       peak %7.1f MiB' % (peak_memory_kb() / 1024.0))
    for step in range(args.steps):
        net.forward_prefilled()
        if step == args.steps - 1:
            blob_memory = {id(storage_of(array)) for b in list(net.blobs.values())
                           + net.learnable_params for array in _stored(b)}
            caches = [(layer_name, attr, size) for layer_name, layer in
                      zip(net._layer_names, net.layers)
                      for attr, size in kept_arrays(layer, net.context.xp, blob_memory).items()]
        net.backward_from()
        print('after step %d:         peak %7.1f MiB' % (step + 1, peak_memory_kb() / 1024.0))
    params = {id(b): b for b in net.learnable_params}
    activations = {id(b): b for b in net.blobs.values()}

    def held(blobs, field):
        arrays = (blob.data if field == 'data' else blob.diff_if_made for blob in blobs.values())
        bases = {id(b): b.nbytes for b in (storage_of(a) for a in arrays if a is not None)}
        return sum(bases.values()) / MIB

    print('params:      data %7.1f MiB, diff %7.1f MiB'
          % (held(params, 'data'), held(params, 'diff')))
    print('activations: data %7.1f MiB, diff %7.1f MiB' % (held(activations, 'data'),
                                                           held(activations, 'diff')))
    total = sum(size for _, _, size in caches)
    print('kept by layers from forward to backward: %.1f MiB' % (total / MIB))
    for layer_name, attr, size in sorted(caches, key=lambda c: -c[2])[:args.top]:
        print('  %-28s %-18s %7.2f MiB' % (layer_name, attr, size / MIB))
    print('PEAK_KB %d' % peak_memory_kb())
    return 0


def compare_with_caffe(args):
    import re

    from caffe_reference import (blas_env, caffe_time, run_measured, temporary_folder,
                                 write_timing_prototxt)
    env = blas_env(args.threads)
    peaks = {'ours': [], 'caffe': []}
    load = os.getloadavg()
    with temporary_folder() as folder:
        prototxt = write_timing_prototxt(args.model, args.batch, folder)
        ours = [sys.executable, os.path.abspath(__file__), prototxt, '--steps', '2']
        for pair in range(args.pairs):
            for who in (('ours', 'caffe') if pair % 2 == 0 else ('caffe', 'ours')):
                if who == 'ours':
                    stdout, _, peak = run_measured(ours, env)
                    own = int(re.search(r'^PEAK_KB (\d+)', stdout, re.M).group(1))
                    if pair == 0:
                        print(stdout[:stdout.index('PEAK_KB')].rstrip())
                        print('(ru_maxrss %.1f MiB, VmHWM %.1f MiB)' % (peak / 1024, own / 1024))
                else:
                    peak = caffe_time(args.compare_caffe, prototxt, 1, env)['peak_kb']
                peaks[who].append(peak)
    ours, caffe = (statistics.median(peaks[w]) / 1024.0 for w in ('ours', 'caffe'))
    print('peak resident memory, 2 TRAIN steps, %d BLAS thread(s), median of %d: ours %.1f MiB, '
          'Caffe %.1f MiB' % (args.threads, args.pairs, ours, caffe))
    print('RATIO memory %.3f (ours / Caffe); load average %.2f %.2f %.2f'
          % (ours / caffe, *load))
    return 0


def plan_list(text):
    from caffe_syncbn.memory_plan import MEMORY_PLANS
    plans = list(MEMORY_PLANS) if text == 'all' else text.split(',')
    unknown = [plan for plan in plans if plan not in MEMORY_PLANS]
    if unknown:
        raise argparse.ArgumentTypeError('unknown memory plan %r (known: %s, all)'
                                         % (unknown[0], ', '.join(MEMORY_PLANS)))
    return plans


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
    args = parser.parse_args(argv)
    if args.steps < 1 or args.pairs < 1:
        parser.error('--steps and --pairs must be at least 1')
    if args.compare_caffe and not os.access(args.compare_caffe, os.X_OK):
        parser.error('%s is not an executable caffe binary' % args.compare_caffe)
    from caffe_syncbn.cli.common import run_main
    run_main(lambda: compare_with_caffe(args) if args.compare_caffe else measure_ours(args))


if __name__ == '__main__':
    main()
