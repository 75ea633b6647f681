#!/usr/bin/env python3
"""How long a snapshot takes (caffemodel and solverstate, written atomically and synced),
the part of the end after SIGTERM that grows with the net: SLURM and Kubernetes send
SIGKILL 30 s after SIGTERM by default (docs/training.md, Signals).

    python benchmarks/snapshot_time.py PROTOTXT [PROTOTXT ...] [--repeats 3] [--folder DIR]

Each net (its data layers turned into Input layers) gets an SGD solver with momentum, as
most of Caffe's solvers have (one history array per param), on one CPU device; the
median of --repeats snapshots is printed with the bytes written.
"""
import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn import caffe_pb2  # noqa: E402
from caffe_syncbn.cli.timing import timing_net_param  # noqa: E402
from caffe_syncbn.training.solvers import get_solver  # noqa: E402


def snapshot_seconds(model, folder, repeats):
    """(median seconds, megabytes) of ``repeats`` snapshots of ``model``'s solver."""
    param = caffe_pb2.SolverParameter(base_lr=0.01, momentum=0.9, lr_policy='fixed',
                                      snapshot_prefix=os.path.join(folder, 'snap'))
    param.net_param.CopyFrom(timing_net_param(model, 1, force_backward=False))
    with get_solver(param, devices='cpu:1') as solver:
        seconds = []
        for _ in range(repeats):
            paths = solver.snapshot()
            seconds.append(solver.last_snapshot_seconds)
        size = sum(os.path.getsize(p) for p in paths)
    return statistics.median(seconds), size / 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('models', nargs='+')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--folder', help='where to write (default: a temporary folder)')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        for model in args.models:
            seconds, megabytes = snapshot_seconds(model, folder, args.repeats)
            print('%-60s %8.0f MB %7.2f s' % (os.path.basename(model), megabytes, seconds),
                  flush=True)


if __name__ == '__main__':
    main()
