#!/usr/bin/env python3
"""The main job (`make demo`): SyncBN against per-device BN at one image per device.

Generates the synthetic dataset (examples/segmentation/make_dataset.py: scenes that
differ in exposure, colour cast, object scale and class mix), then trains
examples/segmentation/fcn_bn.prototxt twice with tools/train_net.py on 4 devices of one
image each, from the same initial weights, on the same images in the same order, for
the same iterations: once with --sync-bn, once with per-device BatchNorm (as plain
Caffe multi-GPU does). Scores both on the held-out images, plots both runs in one PNG,
and says how many 512x512 training images fit on a device of 8 GiB with the memory plan
the runs used and without it (examples/segmentation/memory_fit.py). Everything lands in
out/demo/. examples/segmentation/sweep.py repeats this over seeds.
"""
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'examples', 'segmentation'))

import compare  # noqa: E402
import memory_fit  # noqa: E402
from make_dataset import make_dataset  # noqa: E402

OUT = os.path.join(ROOT, 'out', 'demo')
SEED = 1


def main():
    start = time.time()
    data = os.path.join(OUT, 'data')
    make_dataset(data)
    devices = compare.demo_devices()
    print('Dataset in %s. Training twice on %s, one image per device, seed %d:'
          % (data, ' '.join(devices).lstrip('-'), SEED), flush=True)
    results = compare.run_pair(OUT, data, SEED, devices)
    plot = compare.plot_pair(os.path.join(OUT, 'syncbn_vs_per_device.png'), results,
                             'fcn_bn, 4 devices x 1 image, seed %d' % SEED)
    print()
    print('Held-out images (%s)   pixel accuracy   mean IoU' % os.path.join(data, 'val.txt'))
    for run in results.values():
        print('  %-13s %26.4f %10.4f' % (run['label'], run['pixel_accuracy'], run['mean_iou']))
    per_device = results['per-device']
    print('Why: per-device BN normalized each training image with its own statistics, and at\n'
          'test time normalizes with running averages over many images. Scored with each\n'
          "image's own statistics, as in its training, the same per-device net gets a mean IoU\n"
          'of %.4f (examples/segmentation/evaluate.py --own-statistics).'
          % per_device['own_statistics_mean_iou'])
    print('One seed is one sample: examples/segmentation/sweep.py runs three of each mode.')
    print()
    for line in memory_fit.report():
        print(line)
    print('The whole demo took %.0f s.' % (time.time() - start))
    print('Plot:      %s' % plot)
    print('Results:   %s' % os.path.join(OUT, 'results.json'))
    for run in results.values():
        print('%-10s %s, %s' % (run['label'].split()[0] + ':', run['log'], run['snapshot']))


if __name__ == '__main__':
    main()
