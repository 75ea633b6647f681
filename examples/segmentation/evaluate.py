#!/usr/bin/env python3
"""Pixel accuracy and mean IoU of a trained segmentation net on the held-out list.

    python examples/segmentation/evaluate.py WEIGHTS [--model fcn_bn.prototxt] [--images 128]

Run it from examples/segmentation (the net's list files are relative to that folder).
The net runs in TEST phase, so batch norm uses its running statistics. Snapshots of
`train_net.py --sync-bn` speak the prototxt's own terms (BatchNorm+Scale), so they load
into the net as written, like those of a plain run.

--own-statistics is a diagnostic: every BatchNorm normalizes each image with that image's
own statistics (use_global_stats: false, one image per batch), as it did in training at
one image per device, instead of with the running averages.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..'))

import caffe_syncbn as caffe  # noqa: E402
from caffe_syncbn.cli.common import run_main  # noqa: E402

IGNORE = 255


def confusion(prediction, label, classes):
    """classes x classes counts of (true, predicted) over the pixels not ignored."""
    keep = label != IGNORE
    index = label[keep].astype(np.int64) * classes + prediction[keep].astype(np.int64)
    return np.bincount(index, minlength=classes * classes).reshape(classes, classes)


def scores(matrix):
    """Pixel accuracy, mean IoU and the per-class IoUs of a confusion matrix."""
    true_positive = np.diag(matrix).astype(np.float64)
    union = matrix.sum(0) + matrix.sum(1) - true_positive
    iou = np.where(union > 0, true_positive / np.maximum(union, 1), np.nan)
    return true_positive.sum() / max(matrix.sum(), 1), float(np.nanmean(iou)), iou


def load_test_net(model, weights, own_statistics=False):
    """The TEST net of ``model`` with ``weights`` loaded; see the module doc for
    ``own_statistics``."""
    param = caffe.net.load_net_param(model)
    if own_statistics:
        for layer in param.layer:
            if layer.type == 'BatchNorm':
                layer.batch_norm_param.use_global_stats = False
            if layer.HasField('image_data_param'):
                layer.image_data_param.batch_size = 1
    return caffe.Net(param, caffe.TEST, weights=weights)


def evaluate(weights, model='fcn_bn.prototxt', images=128, own_statistics=False):
    net = load_test_net(model, weights, own_statistics)
    scores_blob = [name for name in net.top_names.values() for name in name
                   if net.blobs[name].data.ndim == 4 and name != 'data'][-1]
    matrix, seen = None, 0
    while seen < images:
        net.forward()
        logits = caffe.backend.to_numpy(net.blobs[scores_blob].data)
        label = caffe.backend.to_numpy(net.blobs['label'].data)[:, 0]
        take = min(images - seen, logits.shape[0])
        counts = confusion(logits[:take].argmax(axis=1), label[:take], logits.shape[1])
        matrix = counts if matrix is None else matrix + counts
        seen += take
    return scores(matrix)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('weights')
    p.add_argument('--model', default='fcn_bn.prototxt')
    p.add_argument('--images', type=int, default=128, help='held-out images (the val list)')
    p.add_argument('--own-statistics', action='store_true',
                   help="normalize each image with its own statistics, not the running ones")
    args = p.parse_args(argv)
    accuracy, miou, iou = evaluate(args.weights, args.model, args.images, args.own_statistics)
    print('pixel accuracy %.4f, mean IoU %.4f' % (accuracy, miou))
    print('per-class IoU: ' + ', '.join('%.3f' % v for v in iou))
    return 0


if __name__ == '__main__':
    run_main(main)
