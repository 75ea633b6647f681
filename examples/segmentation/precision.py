#!/usr/bin/env python3
"""The demo's SyncBN run in mixed precision against float32: held-out mean IoU of each.

    python examples/segmentation/precision.py [--precisions float16 bfloat16] [--seed 1]
        [--out out/precision]

examples/demo.py's SyncBN run (compare.py: fcn_bn on 4 devices of one image each, the
same solver, dataset and initial weights) once in float32 and once in each precision of
--precisions (``tools/train_net.py --sync-bn --precision P``); the snapshots are float32
caffemodels either way, each scored on the held-out images (evaluate.py, a float32 TEST
net). Prints each run's pixel accuracy and mean IoU and its difference from float32, and
writes OUT/precision.json. A run of 2000 iterations takes 1 to 5 minutes on 2 cores
(float16's conversions cost the most: numpy converts float16 slowly).
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import compare  # noqa: E402
from evaluate import evaluate  # noqa: E402
from make_dataset import make_dataset  # noqa: E402


def run(out, data, seed, precisions, devices=None, solver_overrides=None,
        progress=compare.say):
    """{precision: {command, log, snapshot, seconds, pixel_accuracy, mean_iou}} of the
    SyncBN runs, float32 first; written to out/precision.json too."""
    os.makedirs(out, exist_ok=True)
    net_path, solver_path = compare.write_net_and_solver(out, data, seed, solver_overrides)
    init = compare.write_initial_weights(net_path, os.path.join(out, 'init.caffemodel'), seed)
    with open(os.path.join(data, 'val.txt')) as f:
        held_out = sum(1 for line in f if line.strip())
    results = {}
    for precision in ['float32'] + [p for p in precisions if p != 'float32']:
        run_dir = os.path.join(out, precision)
        label = 'SyncBN %s' % precision
        command, seconds = compare.train(run_dir, solver_path, init,
                                         ['--sync-bn', '--precision', precision],
                                         devices or compare.demo_devices(), label, progress)
        snapshot = compare.final_snapshot(run_dir, solver_path)
        accuracy, miou, _ = evaluate(snapshot, net_path, held_out)
        results[precision] = {'command': command, 'log': os.path.join(run_dir, 'train.log'),
                              'snapshot': snapshot, 'seconds': seconds,
                              'pixel_accuracy': float(accuracy), 'mean_iou': float(miou)}
        progress('  %-17s done in %.0f s: held-out pixel accuracy %.4f, mean IoU %.4f'
                 % (label, seconds, accuracy, miou))
    compare.write_json(os.path.join(out, 'precision.json'), results)
    return results


def main(argv=None):
    root = os.path.dirname(os.path.dirname(HERE))
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--precisions', nargs='+', default=['float16', 'bfloat16'],
                   choices=['float16', 'bfloat16'])
    p.add_argument('--seed', type=int, default=1, help='initial weights, data order (1)')
    p.add_argument('--out', default=os.path.join(root, 'out', 'precision'))
    args = p.parse_args(argv)
    start = time.time()
    data = os.path.join(root, 'out', 'demo', 'data')     # the demo's dataset, made once
    make_dataset(data)
    results = run(os.path.abspath(args.out), data, args.seed, args.precisions)
    print()
    print('Held-out images, SyncBN, seed %d   pixel accuracy   mean IoU   mean IoU - float32'
          % args.seed)
    reference = results['float32']['mean_iou']
    for precision, result in results.items():
        miou = result['mean_iou']
        print('  %-31s %14.4f %10.4f %+20.4f' % (precision, result['pixel_accuracy'], miou,
                                                 miou - reference))
    print('took %.0f s; %s' % (time.time() - start, os.path.join(args.out, 'precision.json')))


if __name__ == '__main__':
    main()
