#!/usr/bin/env python3
"""What SyncBN's check of a batch's statistics costs on the host: the running-statistics
update of one layer with the check that skips it for a batch whose statistics are not
finite (SyncBN.update_statistics: a check of mean + var and a ``where`` per blob) against
the bare update (RunningAverage.update), per number of channels; and the sum over the
SyncBN layers of the demo net (examples/segmentation/fcn_bn.prototxt under -sync_bn), the
cost per iteration.

    python benchmarks/syncbn_checks.py [--repeats 20000]

Each figure is the best of 5 runs of ``--repeats`` calls. The comparison of calls across
processes is mpi_scaling.py's.
"""
import argparse
import os
import sys
import timeit

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from caffe_syncbn import TRAIN, Net  # noqa: E402
from caffe_syncbn.blob import Blob  # noqa: E402
from caffe_syncbn.convert import to_syncbn  # noqa: E402
from caffe_syncbn.layer import LayerContext, create_layer  # noqa: E402
from caffe_syncbn.netparam.upgrade import load_net_param  # noqa: E402
from caffe_syncbn.testing import layer_param  # noqa: E402

CHANNELS = (16, 64, 256, 1024)


def seconds_per_update(channels, repeats):
    """(bare update, update with the check) of one SyncBN layer of ``channels``."""
    layer = create_layer(layer_param('name: "bn" type: "SyncBN" bottom: "x" top: "y" '
                                     'bn_param { momentum: 0.9 }'), LayerContext())
    bottom, top = [Blob((2, channels, 4, 4), np.float32)], [Blob((), np.float32)]
    layer.setup(bottom, top)
    rs = np.random.RandomState(0)
    count, mean, var = np.full(1, 32.0), rs.rand(channels), rs.rand(channels) + 1

    def best(fn):
        return min(timeit.repeat(fn, number=repeats, repeat=5)) / repeats
    return (best(lambda: layer.statistics.update(count, mean, var)),
            best(lambda: layer.update_statistics(count, mean, var)))


def demo_channels():
    """The channels of every SyncBN layer of the demo net under -sync_bn."""
    param = to_syncbn(load_net_param(os.path.join(ROOT, 'examples', 'segmentation',
                                                  'fcn_bn.prototxt')))[0]
    for layer in param.layer:             # its data layer reads files that need not exist
        if layer.type == 'SegData':
            layer.type = 'Input'
            layer.input_param.shape.add().dim.extend([1, 3, 64, 64])
            layer.input_param.shape.add().dim.extend([1, 1, 64, 64])
            layer.ClearField('seg_data_param')
            layer.ClearField('transform_param')
    net = Net(param, TRAIN)
    return [layer.channels for layer in net.layers if layer.type == 'SyncBN']


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--repeats', type=int, default=20000)
    args = parser.parse_args()
    print('machine: %d CPU cores; load average %.2f %.2f %.2f'
          % ((os.cpu_count() or 1,) + os.getloadavg()))
    print('%8s %12s %14s %10s' % ('channels', 'update', 'with check', 'extra'))
    costs = {}
    for channels in CHANNELS:
        bare, checked = seconds_per_update(channels, args.repeats)
        costs[channels] = checked - bare
        print('%8d %9.1f us %11.1f us %7.1f us' % (channels, bare * 1e6, checked * 1e6,
                                                   (checked - bare) * 1e6))
    layers = demo_channels()
    extra = sum(checked - bare for bare, checked in
                (seconds_per_update(c, args.repeats // 4) for c in layers))
    print('demo net (fcn_bn, -sync_bn): %d SyncBN layers, the check adds %.2f ms per replica '
          'and iteration' % (len(layers), extra * 1e3))


if __name__ == '__main__':
    main()
