#!/usr/bin/env python3
"""Forward, backward and per-layer times of a net, like `caffe time`.

    python benchmarks/net_time.py PROTOTXT --batch N --iterations K

Data layers are swapped for Input layers of the same tops; weights come from the
prototxt's fillers. Reference: BVLC Caffe (CPU, OpenBLAS, 2 threads) took about
505 ms for forward+backward of ResNet-50 deploy at batch 2 on a 2-core machine.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn.tools_common import build_timing_net, run_main  # noqa: E402
from caffe_syncbn.timing import format_timings, time_net  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('model', help='net prototxt')
    parser.add_argument('--batch', type=int, default=None, help='batch size (default: the prototxt\'s)')
    parser.add_argument('--iterations', type=int, default=10)
    parser.add_argument('--phase', choices=['TRAIN', 'TEST'], default='TRAIN')
    args = parser.parse_args(argv)
    net = build_timing_net(args.model, args.batch, args.phase)
    result = time_net(net, args.iterations)
    types = {name: layer.type for name, layer in zip(net._layer_names, net.layers)}
    for line in format_timings(result, types):
        print(line)


if __name__ == '__main__':
    run_main(main)
