#!/usr/bin/env python3
"""Peak memory of scoring a net (TEST forwards): the memory plan against every blob kept,
and against Caffe's `caffe test`, in the same run.

    python benchmarks/scoring_memory.py PROTOTXT [--batch N] [--iterations 2] [--pairs 3]
                                     [--compare-caffe PATH/TO/caffe]

The prototxt's data layers become Input layers of --batch (timing.timing_net_param,
without forced backward); weights are drawn by the fillers once and written to a
caffemodel that every run loads. Each run is `caffe-syncbn test -memory_plan share`,
`caffe-syncbn test -memory_plan off` or `caffe test` (the same flags), in a process of its
own, alternating, --pairs times; the peak resident memory (ru_maxrss) of each is taken
alike, and the medians are printed with their ratios.
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_reference import blas_env, run_measured, temporary_folder  # noqa: E402

MIB = 1024.0


def write_model(model, batch, folder):
    """The scored prototxt and a caffemodel of filler weights; their paths."""
    from google.protobuf import text_format

    from caffe_syncbn import TEST, Net
    from caffe_syncbn.analysis.timing import timing_net_param
    param = timing_net_param(model, batch, force_backward=False)
    prototxt, weights = os.path.join(folder, 'scored.prototxt'), os.path.join(folder, 'w.caffemodel')
    with open(prototxt, 'w') as f:
        f.write(text_format.MessageToString(param))
    Net(param, TEST).save(weights)
    return prototxt, weights


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('model', help='net prototxt')
    parser.add_argument('--batch', type=int, default=None,
                        help="batch size of every input (default: the prototxt's)")
    parser.add_argument('--iterations', type=int, default=2, help='forwards per run (default 2)')
    parser.add_argument('--pairs', type=int, default=3, help='alternating rounds (default 3)')
    parser.add_argument('--threads', type=int, default=2, help='BLAS threads (default 2)')
    parser.add_argument('--compare-caffe', metavar='CAFFE', help='path of the caffe binary')
    args = parser.parse_args(argv)
    if args.compare_caffe and not os.access(args.compare_caffe, os.X_OK):
        parser.error('%s is not an executable caffe binary' % args.compare_caffe)
    env = blas_env(args.threads)
    load = os.getloadavg()
    with temporary_folder() as folder:
        prototxt, weights = write_model(args.model, args.batch, folder)
        flags = ['test', '-model', prototxt, '-weights', weights, '-iterations',
                 str(args.iterations)]
        ours = [sys.executable, '-m', 'caffe_syncbn'] + flags
        runs = {'share': ours + ['-memory_plan', 'share'], 'off': ours + ['-memory_plan', 'off']}
        if args.compare_caffe:
            runs['caffe'] = [args.compare_caffe] + flags
        peaks = {name: [] for name in runs}
        for round_ in range(args.pairs):
            order = list(runs) if round_ % 2 == 0 else list(reversed(list(runs)))
            for name in order:
                peaks[name].append(run_measured(runs[name], env)[2])
    median = {name: statistics.median(values) / MIB for name, values in peaks.items()}
    print('peak resident memory of %d TEST forward(s), median of %d: %s'
          % (args.iterations, args.pairs,
             ', '.join('%s %.1f MiB' % (name, mib) for name, mib in median.items())))
    print('RATIO share/off %.3f' % (median['share'] / median['off']))
    if 'caffe' in median:
        print('RATIO share/caffe %.3f, off/caffe %.3f'
              % (median['share'] / median['caffe'], median['off'] / median['caffe']))
    print('load average %.2f %.2f %.2f' % load)
    return 0


if __name__ == '__main__':
    from caffe_syncbn.cli.common import run_main
    run_main(main)
