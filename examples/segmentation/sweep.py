#!/usr/bin/env python3
"""The demo's comparison over several seeds: SyncBN against per-device BN, mean and spread.

    python examples/segmentation/sweep.py [--seeds 1 2 3] [--out out/sweep]

For each seed, examples/demo.py's pair of runs (compare.run_pair): one initial caffemodel
drawn with that seed, the solver's random_seed (data order and augmentation) set to it,
both modes trained from it on the same dataset (make_dataset.py, seed 0). Prints each
seed's held-out mean IoU and pixel accuracy, then per mode the mean and the sample
standard deviation over the seeds, and the same for the per-seed difference
(SyncBN - per-device BN). Writes OUT/sweep.json. About 2.5 minutes per seed on 2 cores.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import compare  # noqa: E402
from make_dataset import make_dataset  # noqa: E402

METRICS = (('mean_iou', 'mean IoU'), ('pixel_accuracy', 'pixel accuracy'))


def spread(values):
    """'mean +- sample std (n)' of ``values``."""
    values = np.asarray(values, np.float64)
    std = values.std(ddof=1) if len(values) > 1 else float('nan')
    return '%.4f +- %.4f (n=%d)' % (values.mean(), std, len(values))


def summarize(runs):
    """Lines of the sweep's table: each seed, then mean +- std per mode and of the difference."""
    modes = [folder for folder, _, _ in compare.MODES]
    labels = {folder: label for folder, label, _ in compare.MODES}
    lines = []
    for key, name in METRICS:
        lines.append('held-out %s' % name)
        for seed, results in sorted(runs.items()):
            lines.append('  seed %-3d %s' % (seed, '   '.join(
                '%s %.4f' % (labels[m], results[m][key]) for m in modes)))
        for m in modes:
            lines.append('  %-25s %s' % (labels[m], spread([r[m][key] for r in runs.values()])))
        lines.append('  %-25s %s' % ('%s - %s' % (labels[modes[0]], labels[modes[1]]), spread(
            [r[modes[0]][key] - r[modes[1]][key] for r in runs.values()])))
    lines.append('held-out mean IoU of the per-device BN nets, each image normalized by its own '
                 'statistics (as in their training)')
    lines.append('  %-25s %s' % ('per-device BN', spread(
        [r['per-device']['own_statistics_mean_iou'] for r in runs.values()])))
    return lines


def main(argv=None):
    root = os.path.dirname(os.path.dirname(HERE))
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--seeds', type=int, nargs='+', default=[1, 2, 3])
    p.add_argument('--out', default=os.path.join(root, 'out', 'sweep'))
    args = p.parse_args(argv)
    start = time.time()
    data = os.path.join(args.out, 'data')
    make_dataset(data)
    devices = compare.demo_devices()
    runs = {}
    for seed in args.seeds:
        print('seed %d on %s:' % (seed, ' '.join(devices).lstrip('-')), flush=True)
        runs[seed] = compare.run_pair(os.path.join(args.out, 'seed%d' % seed), data, seed,
                                      devices)
    lines = summarize(runs)
    print('\n' + '\n'.join(lines))
    print('%d seeds in %.0f s' % (len(args.seeds), time.time() - start))
    compare.write_json(os.path.join(args.out, 'sweep.json'), runs)
    print('wrote %s' % os.path.join(args.out, 'sweep.json'))
    return 0


if __name__ == '__main__':
    sys.exit(main())
