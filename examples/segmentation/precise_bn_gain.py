#!/usr/bin/env python3
"""PreciseBN on the demo: the held-out scores of both demo runs before and after
`caffe-syncbn precise_bn`.

    python examples/segmentation/precise_bn_gain.py [--seeds 1 2 3] [--iterations 250]
                                                    [--out out/precise_bn]

For each seed, the demo's pair of runs (compare.run_pair: SyncBN and per-device BN, the
demo's net and solver, 2000 iterations; reused where OUT/seedS/results.json is there),
then, for each run's final snapshot, `caffe-syncbn precise_bn` over ITERATIONS global
batches of the training set on the demo's devices (4 of one image each: 250 batches are
the 1000 training images once, augmented as in training), scored on the 128 held-out
images as the demo scores them. Prints each run's mean IoU and pixel accuracy before and
after, and their mean and spread over the seeds; writes OUT/precise_bn.json.

Beside it, the PreciseBN of fvcore and detectron2, for comparison: one pass over the same
number of images in which every BatchNorm normalizes with its batch's statistics and keeps
their plain average (BatchNorm with moving_average_fraction 1, from zero sums), in batches
of 1 image (what those tools compute on one device of the demo's four: they do not
synchronize) and of 4 (the global batch, synchronized but not layer by layer).
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import compare  # noqa: E402
import caffe_syncbn as caffe  # noqa: E402
from evaluate import evaluate  # noqa: E402
from make_dataset import make_dataset  # noqa: E402
from sweep import spread  # noqa: E402

#: the batches of the anchors' PreciseBN: one device's, and the demo's global batch
BATCHES = (1, 4)


def precise(run, net_path, iterations, devices, held_out):
    """`caffe-syncbn precise_bn` of one run's snapshot; its scores and the seconds it took."""
    output = os.path.join(os.path.dirname(run['snapshot']), 'precise_bn.caffemodel')
    command = [sys.executable, '-m', 'caffe_syncbn', 'precise_bn', '-model', net_path,
               '-weights', run['snapshot'], '-iterations', str(iterations),
               '-output', output] + devices
    start = time.time()
    done = subprocess.run(command, cwd=os.path.dirname(net_path), stderr=subprocess.PIPE,
                          text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    if done.returncode:
        sys.stderr.write(done.stderr[-3000:])
        raise SystemExit('error: %s failed (exit %d)' % (' '.join(command), done.returncode))
    seconds = time.time() - start
    accuracy, miou, _ = evaluate(output, net_path, held_out)
    return {'command': command, 'weights': output, 'seconds': seconds,
            'pixel_accuracy': float(accuracy), 'mean_iou': float(miou)}


def batch_average(run, net_path, images, batch, held_out):
    """The anchors' PreciseBN of one run's snapshot (module docstring) in batches of
    ``batch`` images; its scores."""
    param = caffe.net.load_net_param(net_path)
    for layer in param.layer:
        if layer.type == 'BatchNorm':
            layer.batch_norm_param.moving_average_fraction = 1
        if layer.HasField('image_data_param'):
            layer.image_data_param.batch_size = batch
    caffe.set_random_seed(1701)
    net = caffe.Net(param, caffe.TRAIN, weights=run['snapshot'])
    for layer in net.layers:
        if layer.type == 'BatchNorm':
            for blob in layer.blobs:
                blob.data[...] = 0
    for _ in range(images // batch):
        net.forward()
    output = os.path.join(os.path.dirname(run['snapshot']), 'batch_average_%d.caffemodel' % batch)
    net.save(output)
    accuracy, miou, _ = evaluate(output, net_path, held_out)
    return {'weights': output, 'pixel_accuracy': float(accuracy), 'mean_iou': float(miou)}


def pair_of(out, data, seed, devices):
    results = os.path.join(out, 'results.json')
    if os.path.exists(results):
        with open(results) as f:
            return json.load(f)
    return compare.run_pair(out, data, seed, devices)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--seeds', type=int, nargs='+', default=[1])
    p.add_argument('--iterations', type=int, default=250)
    p.add_argument('--out', default=os.path.join(ROOT, 'out', 'precise_bn'))
    args = p.parse_args(argv)
    data = os.path.join(args.out, 'data')
    make_dataset(data)
    with open(os.path.join(data, 'val.txt')) as f:
        held_out = sum(1 for line in f if line.strip())
    devices = compare.demo_devices()
    found = {}
    for seed in args.seeds:
        out = os.path.join(args.out, 'seed%d' % seed)
        pair = pair_of(out, data, seed, devices)
        net_path = os.path.join(out, 'fcn_bn.prototxt')
        images = args.iterations * 4          # the demo's global batch: 4 devices of 1 image
        for folder, run in pair.items():
            run['precise_bn'] = precise(run, net_path, args.iterations, devices, held_out)
            for batch in BATCHES:
                run['batch_average_%d' % batch] = batch_average(run, net_path, images, batch,
                                                                held_out)
            print('seed %d, %-13s mean IoU %.4f -> %.4f (PreciseBN, %.0f s); %s' % (
                seed, run['label'], run['mean_iou'], run['precise_bn']['mean_iou'],
                run['precise_bn']['seconds'], ', '.join(
                    'batch average of %d: %.4f' % (batch, run['batch_average_%d' % batch]
                                                  ['mean_iou']) for batch in BATCHES)),
                  flush=True)
        found[seed] = pair
    print()
    for folder, label, _ in compare.MODES:
        for key, name in (('mean_iou', 'mean IoU'), ('pixel_accuracy', 'pixel accuracy')):
            before = [pair[folder][key] for pair in found.values()]
            print('%s, %s: trained %s' % (label, name, spread(before)))
            for column in ['precise_bn'] + ['batch_average_%d' % batch for batch in BATCHES]:
                after = [pair[folder][column][key] for pair in found.values()]
                print('  %-16s %s, gain %s' % (column, spread(after), spread(
                    [a - b for a, b in zip(after, before)])))
    compare.write_json(os.path.join(args.out, 'precise_bn.json'), found)
    print('wrote %s' % os.path.join(args.out, 'precise_bn.json'))
    return 0


if __name__ == '__main__':
    sys.exit(main())
