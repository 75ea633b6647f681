#!/usr/bin/env python3
"""Synchronous against asynchronous data parallelism when one replica is slow.

    python benchmarks/sync_vs_async.py [--iterations 300] [--devices 4] [--slowdown 3]
                                       [--max-staleness K] [--out out/sync_vs_async]

The demo's net and data (examples/segmentation: fcn_bn.prototxt, one image per device,
per-device BatchNorm since -async refuses SyncBN) train on ``--devices`` virtual CPU
devices from one initial caffemodel, with the last replica slowed: it sleeps
``slowdown - 1`` times the measured time of one replica's forward-backward before each
of its own. Both modes see the same images per iteration (devices x 1) and run the
same solver (the demo's, shortened to ``--iterations``):

* sync: every iteration waits for the slow replica ("the slowest device sets the pace");
* async: the other replicas go on updating the shared params; the slow replica's
  gradients arrive late (stale);
* async with ``--max-staleness K`` as well, when given.

It prints each mode's throughput (images per second, and as a ratio to sync measured in
the same run), the median forward-backward time of a fast replica and of the slow one as
they ran (the machine's load moves them; in sync a fast replica's includes its wait for
the slow one at the loss normalizer's allreduce), its training loss every 10% of the run (the
solver's smoothed loss), the held-out loss and pixel accuracy at the end, and the
staleness of the asynchronous updates (updates applied between a replica's read of the
params and its own update).
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'examples', 'segmentation'))

import compare  # noqa: E402
from make_dataset import make_dataset  # noqa: E402

import caffe_syncbn as caffe  # noqa: E402
from caffe_syncbn.training.solvers import get_solver  # noqa: E402


def slow_down(net, seconds):
    original = net.forward_backward

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)
    net.forward_backward = slow


def replica_step_seconds(solver_path, init, warmup=3, repeats=10):
    """The median time of one replica's forward-backward, alone on the machine."""
    solver = get_solver(solver_path, devices='cpu:1', weights=[init])
    net = solver.replicas[0]
    times = []
    for _ in range(warmup):
        solver.next_parts()
        net.forward_backward()
    for _ in range(repeats):
        solver.next_parts()
        start = time.perf_counter()
        solver.pool.run_on(0, net.forward_backward)
        times.append(time.perf_counter() - start)
    solver.close()
    return sorted(times)[len(times) // 2]


def timed(net, times):
    original = net.forward_backward

    def run(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return result
    net.forward_backward = run


def median(values):
    return sorted(values)[len(values) // 2]


def train(solver_path, init, devices, sleep, mode, max_staleness, iterations):
    """(seconds, [(iteration, smoothed loss)], held-out (loss, accuracy), staleness,
    median seconds of a fast and of the slow replica's steps)."""
    solver = get_solver(solver_path, devices='cpu:%d' % devices, weights=[init], mode=mode,
                        max_staleness=max_staleness)
    fast, slow = [], []
    for net in solver.replicas[:-1]:
        timed(net, fast)
    slow_down(solver.replicas[-1], sleep)
    timed(solver.replicas[-1], slow)
    curve = []

    def record():
        if solver.iter > 0 and solver.iter % max(1, iterations // 10) == 0 and \
                (not curve or curve[-1][0] != solver.iter):
            curve.append((solver.iter, solver.smoothed_loss))
    solver.action_request = record
    start = time.perf_counter()
    solver.step(iterations)
    seconds = time.perf_counter() - start
    held_out = solver.test(0)
    staleness = list(solver.strategy.holder.staleness) if mode == 'async' else []
    solver.close()
    return seconds, curve, (held_out['loss'], held_out['accuracy']), staleness, \
        (median(fast), median(slow))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--iterations', type=int, default=300)
    parser.add_argument('--devices', type=int, default=4)
    parser.add_argument('--slowdown', type=float, default=3.0,
                        help='how many times slower the last replica is (default 3)')
    parser.add_argument('--max-staleness', type=int, default=None)
    parser.add_argument('--out', default=os.path.join(ROOT, 'out', 'sync_vs_async'))
    parser.add_argument('--seed', type=int, default=1)
    args = parser.parse_args(argv)
    import logging
    logging.getLogger('caffe_syncbn').setLevel(logging.WARNING)
    data = os.path.join(args.out, 'data')
    if not os.path.isdir(data):
        make_dataset(data, train=400, val=64)
    net_path, solver_path = compare.write_net_and_solver(
        args.out, data, args.seed, {'max_iter': args.iterations, 'test_interval': 100000,
                                    'display': 0, 'snapshot_after_train': False,
                                    'test_iter': 8, 'average_loss': 20})
    init = compare.write_initial_weights(net_path, os.path.join(args.out, 'init.caffemodel'),
                                         args.seed)
    step = replica_step_seconds(solver_path, init)
    sleep = (args.slowdown - 1) * step
    print('fcn_bn, %d virtual CPU devices x 1 image, %d iterations; one replica forward-'
          'backward takes %.1f ms, replica %d sleeps %.1f ms more (%.1fx slower)'
          % (args.devices, args.iterations, step * 1e3, args.devices - 1, sleep * 1e3,
             args.slowdown), flush=True)
    modes = [('sync', 'sync', None), ('async', 'async', None)]
    if args.max_staleness is not None:
        modes.append(('async K=%d' % args.max_staleness, 'async', args.max_staleness))
    runs = {}
    for label, mode, bound in modes:
        caffe.set_random_seed(args.seed)
        runs[label] = train(solver_path, init, args.devices, sleep, mode, bound, args.iterations)
        print('  %s: %.1f s' % (label, runs[label][0]), flush=True)
    images = args.iterations * args.devices
    sync_seconds = runs['sync'][0]
    print()
    print('%-12s %9s %8s %9s %11s %12s %11s  %s' % (
        'mode', 'images/s', 'vs sync', 'held-out', 'pixel acc.', 'fast step', 'slow step',
        'staleness'))
    for label, (seconds, _, (loss, accuracy), staleness, steps) in runs.items():
        stale = ('mean %.1f max %d' % (sum(staleness) / len(staleness), max(staleness))
                 if staleness else '-')
        print('%-12s %9.1f %7.2fx %9.4f %11.4f %9.1f ms %8.1f ms  %s' % (
            label, images / seconds, sync_seconds / seconds, loss, accuracy, steps[0] * 1e3,
            steps[1] * 1e3, stale))
    print()
    print('training loss (smoothed over 20 iterations)')
    print('%-10s' % 'iteration' + ''.join('%14s' % label for label in runs))
    curves = [dict(run[1]) for run in runs.values()]
    for iteration in sorted(set().union(*curves)):
        print('%-10d' % iteration + ''.join('%14s' % ('%.4f' % c[iteration] if iteration in c
                                                       else '-') for c in curves))


if __name__ == '__main__':
    main()
