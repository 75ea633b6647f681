#!/usr/bin/env python3
"""Score a trained net on its test data, as `caffe test` does.

    python tools/test_net.py --model train_val.prototxt --weights net.caffemodel --iterations 50

Runs ``--iterations`` forward passes of the net in TEST phase (its data layers supply the
batches) and logs, in Caffe's format, every output of every batch ("Batch 3, accuracy =
0.98"), the mean loss ("Loss: 0.05") and the mean of each output ("accuracy = 0.9856",
loss outputs with their weight: "loss = 0.05 (* 1 = 0.05 loss)").
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn.errors import CaffeError  # noqa: E402
from caffe_syncbn.tools_common import run_main, setup_logging  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', required=True, help='net prototxt')
    p.add_argument('--weights', required=True, help='caffemodel(s), comma-separated, loaded in order')
    p.add_argument('--iterations', type=int, default=50, help='batches to score (default 50)')
    where = p.add_mutually_exclusive_group()
    where.add_argument('--gpu', type=int, metavar='ID', help='run on this GPU')
    where.add_argument('--cpu', action='store_true', help='run on the CPU (the default)')
    p.add_argument('--phase', choices=['TEST', 'TRAIN'], default='TEST')
    p.add_argument('--level', type=int, default=0, help='NetState level')
    p.add_argument('--stage', action='append', default=[], help='NetState stage (repeatable)')
    args = p.parse_args(argv)
    if args.iterations < 1:
        p.error('--iterations must be at least 1')
    return args


def select_device(gpu):
    """pycaffe's set_mode_gpu/set_device, with one clear error when there is no GPU."""
    import caffe_syncbn
    if gpu is None:
        caffe_syncbn.set_mode_cpu()
        return
    try:
        caffe_syncbn.set_mode_gpu()
    except ImportError as exc:
        raise CaffeError('--gpu %d needs CuPy and an NVIDIA GPU (%s)' % (gpu, exc)) from None
    caffe_syncbn.set_device(gpu)


def main(argv=None):
    args = parse_args(argv)
    log = setup_logging()
    select_device(args.gpu)
    from caffe_syncbn import TEST, TRAIN, Net
    from caffe_syncbn.backend import to_numpy
    for path in [args.model] + args.weights.split(','):
        if not os.path.isfile(path):
            raise CaffeError('file %s does not exist' % path)
    net = Net(args.model, TEST if args.phase == 'TEST' else TRAIN, level=args.level,
              stages=args.stage)
    if args.gpu is not None and net.context.xp is np:
        raise CaffeError('--gpu: this build has no GPU backend for nets; run without --gpu')
    for path in args.weights.split(','):
        net.copy_from(path)
    if net.inputs:
        log.warning('Input blobs %s are not filled by the net; they stay zero',
                    ', '.join(net.inputs))
    log.info('Running for %d iterations.', args.iterations)
    sums, loss = None, 0.0
    for i in range(args.iterations):
        loss += net.forward_prefilled()
        batch = [(name, to_numpy(net.blobs[name].data).astype(np.float64).ravel())
                 for name in net.outputs]
        for name, values in batch:
            for value in values:
                log.info('Batch %d, %s = %g', i, name, value)
        sums = batch if sums is None else [(n, s + v) for (n, s), (_, v) in zip(sums, batch)]
    log.info('Loss: %g', loss / args.iterations)
    for name, total in sums:
        weight = net.output_blob_loss_weights.get(name, 0)
        for mean in total / args.iterations:
            extra = ' (* %g = %g loss)' % (weight, weight * mean) if weight else ''
            log.info('%s = %g%s', name, mean, extra)
    return 0


if __name__ == '__main__':
    run_main(main)
