"""Train the small SSD of ssd_shapes.prototxt twice on 4 virtual CPU devices at 2 images
per device, with SyncBN (statistics over the 8 images of each step) and with per-device
BN (each device's 2 images), from the same initial weights and the same data order, and
report each run's mAP on the held-out images (DetectionEvaluate + detection_map).

    python examples/detection/train.py OUT [--iters 600] [--devices cpu:4]

OUT gets the dataset (make_shapes.py) unless it is already there, and one
<mode>.caffemodel per run. A few hundred iterations take a few minutes on 2 cores.
"""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
sys.path.insert(0, EXAMPLE)

from make_shapes import make_dataset  # noqa: E402

import caffe_syncbn as caffe  # noqa: E402
from caffe_syncbn import caffe_pb2  # noqa: E402
from caffe_syncbn.layers.detection.boxes import detection_map  # noqa: E402
from caffe_syncbn.netparam.prototxt import parse_text  # noqa: E402
from caffe_syncbn.netparam.upgrade import load_net_param  # noqa: E402
from caffe_syncbn import get_solver  # noqa: E402

SOLVER = ('base_lr: 0.05 lr_policy: "multistep" stepvalue: %d gamma: 0.1 momentum: 0.9 '
          'weight_decay: 0.0005 max_iter: %d display: 0 random_seed: %d')
#: (name, whether BatchNorm + Scale become SyncBN)
MODES = (('syncbn', True), ('per-device-bn', False))
TEST_BATCH = 8


def net_param(data):
    param = load_net_param(os.path.join(EXAMPLE, 'ssd_shapes.prototxt'))
    for layer in param.layer:
        if layer.type == 'AnnotatedData':
            layer.data_param.source = os.path.join(data, os.path.basename(
                layer.data_param.source))
    return param


def train_and_test(data, sync_bn, iters, devices, seed, weights_path, test_images):
    solver_param = parse_text(SOLVER % (iters * 2 // 3, iters, seed), caffe_pb2.SolverParameter())
    solver_param.net_param.CopyFrom(net_param(data))
    solver = get_solver(solver_param, devices=devices, sync_bn=sync_bn)
    try:
        solver.step(iters)
        loss = float(caffe.backend.to_numpy(solver.replicas[0].blobs['mbox_loss'].data))
        solver.replicas[0].save(weights_path)
    finally:
        solver.close()
    test = caffe.Net(net_param(data), caffe.TEST, weights=weights_path)
    tops = []
    for _ in range(max(1, test_images // TEST_BATCH)):
        test.forward()
        tops.append(test.blobs['detection_eval'].data.copy())
    mean_ap, per_class = detection_map(tops, '11point')
    return {'final_loss': loss, 'mAP': mean_ap, 'AP': per_class}


def run(out, iters=600, devices='cpu:4', seed=1, train_images=256, test_images=64,
        log=print):
    if not os.path.isdir(os.path.join(out, 'test_lmdb')):
        make_dataset(out, train_images, test_images, seed=0, log=lambda *a: None)
    results = {}
    for name, sync_bn in MODES:
        start = time.time()
        results[name] = train_and_test(out, sync_bn, iters, devices, seed,
                                       os.path.join(out, name + '.caffemodel'), test_images)
        results[name]['seconds'] = round(time.time() - start, 1)
        log('%-14s mAP %.3f  (final loss %.3f, %.0f s)' % (
            name, results[name]['mAP'], results[name]['final_loss'], results[name]['seconds']))
    with open(os.path.join(out, 'results.json'), 'w') as f:
        json.dump(results, f, indent=1, default=float)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('out')
    p.add_argument('--iters', type=int, default=600)
    p.add_argument('--devices', default='cpu:4')
    p.add_argument('--seed', type=int, default=1)
    args = p.parse_args()
    run(args.out, args.iters, args.devices, args.seed)


if __name__ == '__main__':
    main()
