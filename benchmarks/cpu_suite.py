#!/usr/bin/env python3
"""Ours against BVLC Caffe on a suite of nets, CPU, training passes:

    python benchmarks/cpu_suite.py --compare-caffe PATH/TO/caffe [--nets lenet-b64,resnet20-b1]
                                   [--pairs P] [--iterations K] [--threads T] [--memory-plan P]

Each net goes through net_time.py's --compare-caffe (the same prototxt for both, data
layers as Input layers of the net's batch, backward forced, filler weights, each run a
fresh process, alternating pairs, --threads BLAS threads each) and gets its lines there:
every pair, the medians and the time by layer type. At the end, one table: the ratios
ours / Caffe of the median forward, backward and forward+backward times (Caffe's from
`caffe time`'s "Average Forward pass" and "Average Backward pass") and of the median
peak resident memory, with the load average (1 minute) before and after each net and
over the whole run. Ours runs with --memory-plan (default auto, what `caffe-syncbn
time` uses).
"""
import argparse
import os
import sys

from net_time import add_memory_plan_flag, compare_runs, print_by_type

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get('CAFFE_SYNCBN_SHARED', os.path.join(os.path.dirname(ROOT), 'shared'))
CORPUS = os.path.join(SHARED, 'corpus')
NETS_DIR = os.path.join(ROOT, 'benchmarks', 'nets')

#: name: (prototxt, batch, iterations per run: about a second of work or more)
NETS = {
    'lenet-b64': (os.path.join(CORPUS, 'BVLC_caffe__examples_mnist_lenet.prototxt'), 64, 50),
    'resnet20-b1': (os.path.join(NETS_DIR, 'resnet20_cifar_deploy.prototxt'), 1, 50),
    'resnet20-b32': (os.path.join(NETS_DIR, 'resnet20_cifar_deploy.prototxt'), 32, 10),
    'alexnet-b4': (os.path.join(CORPUS, 'BVLC_caffe__models_bvlc_alexnet_deploy.prototxt'), 4, 5),
    'resnet50-b2': (os.path.join(ROOT, 'examples', 'resnet50', 'ResNet-50-deploy.prototxt'), 2, 3),
    'mobilenet-b4': (os.path.join(NETS_DIR, 'mobilenet_v1_deploy.prototxt'), 4, 3),
    'retinaface-640-b1': (os.path.join(NETS_DIR, 'retinaface_mnet025_deploy.prototxt'), 1, 5),
}


def run_suite(args, names):
    rows = []
    first_load = os.getloadavg()[0]
    for name in names:
        model, batch, iterations = NETS[name]
        print('== %s' % name)
        load = os.getloadavg()[0]
        runs, ours, caffe = compare_runs(args.compare_caffe, model, batch,
                                         args.iterations or iterations, args.pairs,
                                         args.threads, args.memory_plan)
        print_by_type(runs)
        rows.append((name, ours, caffe, load, os.getloadavg()[0]))
        print()
    print('ours / Caffe, medians of %d pairs, %d BLAS thread(s) each; load average '
          '(1 minute) %.2f at the start, %.2f at the end'
          % (args.pairs, args.threads, first_load, os.getloadavg()[0]))
    print('| net | forward | backward | forward+backward | peak memory | ours fwd+bwd | '
          'Caffe fwd+bwd | load average |')
    print('|---|---|---|---|---|---|---|---|')
    for name, ours, caffe, before, after in rows:
        print('| %s | %.3f | %.3f | %.3f | %.3f | %.1f ms | %.1f ms | %.1f to %.1f |' % (
            name, *(ours[key] / caffe[key] for key in
                    ('forward_ms', 'backward_ms', 'total_ms', 'peak_kb')),
            ours['total_ms'], caffe['total_ms'], before, after))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--compare-caffe', metavar='CAFFE', required=True,
                        help='path of the caffe binary')
    parser.add_argument('--nets', default=','.join(NETS),
                        help='comma-separated subset of: %s (default: all)' % ', '.join(NETS))
    parser.add_argument('--pairs', type=int, default=3, help='alternating pairs (default 3)')
    parser.add_argument('--iterations', type=int, default=None,
                        help="iterations per run (default: each net's own)")
    parser.add_argument('--threads', type=int, default=2, help='BLAS threads (default 2)')
    add_memory_plan_flag(parser)
    args = parser.parse_args(argv)
    names = [name for name in args.nets.split(',') if name]
    unknown = [name for name in names if name not in NETS]
    if unknown or not names:
        parser.error('--nets: unknown %s (known: %s)' % (', '.join(unknown) or 'nothing',
                                                         ', '.join(NETS)))
    if args.pairs < 1 or (args.iterations is not None and args.iterations < 1) or args.threads < 1:
        parser.error('--pairs, --iterations and --threads must be at least 1')
    if not os.access(args.compare_caffe, os.X_OK):
        parser.error('%s is not an executable caffe binary' % args.compare_caffe)
    sys.path.insert(0, ROOT)
    from caffe_syncbn.cli.common import run_main  # imports numpy
    run_main(lambda: run_suite(args, names))


if __name__ == '__main__':
    main()
