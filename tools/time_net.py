#!/usr/bin/env python3
"""Time a net's forward and backward passes, layer by layer, as `caffe time` does.

    python tools/time_net.py --model net.prototxt [--iterations 50] [--batch 8] [--gpu 0]

A front end with Caffe's flags over the same code as benchmarks/net_time.py: data layers
become Input layers (``--batch`` rows, default the prototxt's batch size), weights come
from the fillers, backward is forced, and the means over ``--iterations`` passes after
one warm-up pass are printed per layer and in total.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn.errors import CaffeError  # noqa: E402
from caffe_syncbn.timing import format_timings, time_net  # noqa: E402
from caffe_syncbn.tools_common import build_timing_net, run_main  # noqa: E402

from test_net import select_device  # noqa: E402  (tools/ is on sys.path as the script's folder)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', required=True, help='net prototxt')
    p.add_argument('--iterations', type=int, default=50, help='timed passes (default 50)')
    p.add_argument('--batch', type=int, help="batch size (default: the prototxt's)")
    p.add_argument('--phase', choices=['TRAIN', 'TEST'], default='TRAIN')
    where = p.add_mutually_exclusive_group()
    where.add_argument('--gpu', type=int, metavar='ID', help='run on this GPU')
    where.add_argument('--cpu', action='store_true', help='run on the CPU (the default)')
    args = p.parse_args(argv)
    if args.iterations < 1:
        p.error('--iterations must be at least 1')
    if not os.path.isfile(args.model):
        raise CaffeError('file %s does not exist' % args.model)
    select_device(args.gpu)
    net = build_timing_net(args.model, args.batch, args.phase)
    if args.gpu is not None and net.context.xp.__name__ == 'numpy':
        raise CaffeError('--gpu: this build has no GPU backend for nets; run without --gpu')
    print('Timing %s (%s phase) for %d iterations.' % (net.name or args.model, args.phase,
                                                        args.iterations))
    result = time_net(net, args.iterations)
    types = {name: layer.type for name, layer in zip(net._layer_names, net.layers)}
    for line in format_timings(result, types):
        print(line)
    return 0


if __name__ == '__main__':
    run_main(main)
