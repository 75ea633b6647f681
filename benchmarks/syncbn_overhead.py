#!/usr/bin/env python3
"""What SyncBN costs: training step time with SyncBN against per-device BN, and scaling.

    python benchmarks/syncbn_overhead.py [--quick]

A BN-heavy ResNet-style net (a conv-BN-ReLU stem, three stages of residual blocks of
conv-BN-ReLU-conv-BN plus shortcut, global average pooling, InnerProduct,
SoftmaxWithLoss; Input layers fed with one fixed random global batch) is trained with
SGD on virtual CPU devices:

* overhead: per-device BN (layer type ``BN``) against the same net with every BN turned
  into SyncBN (``get_solver(..., sync_bn=True)``), on 2 virtual devices (one per core of
  a 2-core machine; target: at most 1.05x) and on 4, printed as the ratios of median step
  times;
* scaling: SyncBN on 1, 2 and 4 devices at the same global batch (images/s, speed-up).

All solvers are built first and then stepped round-robin, one step each per round, so
every configuration sees the same machine load; each figure is the median of the
timed steps after the warm-up steps. The virtual devices are threads of one process,
so the speed-up on a CPU is bounded by how much of a step releases the GIL (BLAS, large
numpy operations) and by the number of cores.

BLAS runs single-threaded here unless OPENBLAS_NUM_THREADS / OMP_NUM_THREADS /
MKL_NUM_THREADS say otherwise: a virtual device is one core's worth of work, and four
device threads each starting a multi-threaded GEMM on a small machine oversubscribe
its cores (on 2 cores that made every step 3-10x slower and the figures meaningless).
"""
import argparse
import os
import sys
import time

for _name in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS'):
    os.environ.setdefault(_name, '1')       # before numpy loads its BLAS

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn import caffe_pb2  # noqa: E402
from caffe_syncbn.cli.common import run_main  # noqa: E402
from caffe_syncbn.errors import CaffeError  # noqa: E402
from caffe_syncbn.pycaffe.net_spec import NetSpec, layers as L, params as P  # noqa: E402

FULL = dict(size=32, width=16, blocks=2, batch=32, warmup=3, steps=15)
QUICK = dict(size=16, width=8, blocks=1, batch=8, warmup=1, steps=2)
CLASSES = 10


def _conv(bottom, channels, kernel, stride=1):
    return L.Convolution(bottom, num_output=channels, kernel_size=kernel, stride=stride,
                         pad=kernel // 2, bias_term=False,
                         weight_filler=dict(type='msra'))


def _bn(bottom):
    """Per-device BN of the forks; sync_bn=True makes it SyncBN (same blobs, same params)."""
    return L.BN(bottom, slope_filler=dict(type='constant', value=1),
                bias_filler=dict(type='constant', value=0), momentum=0.9)


def resnet_param(local_batch, size, width, blocks):
    """The benchmark net for ``local_batch`` images of 3 x size x size per device."""
    n = NetSpec()
    n.data, n.label = L.Input(ntop=2, input_param=dict(shape=[
        dict(dim=[local_batch, 3, size, size]), dict(dim=[local_batch])]))
    x = L.ReLU(_bn(_conv(n.data, width, 3)), in_place=True)
    channels = width
    for stage in range(3):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            if stride > 1:
                channels *= 2
            branch = L.ReLU(_bn(_conv(x, channels, 3, stride)), in_place=True)
            branch = _bn(_conv(branch, channels, 3))
            shortcut = x if stride == 1 else _bn(_conv(x, channels, 1, stride))
            x = L.ReLU(L.Eltwise(branch, shortcut), in_place=True)
    x = L.Pooling(x, pool=P.Pooling.AVE, global_pooling=True)
    n.fc = L.InnerProduct(x, num_output=CLASSES, weight_filler=dict(type='xavier'))
    n.loss = L.SoftmaxWithLoss(n.fc, n.label)
    net = n.to_proto()
    net.name = 'syncbn_overhead_resnet'
    return net


def solver_param(net):
    p = caffe_pb2.SolverParameter(type='SGD', base_lr=0.01, momentum=0.9, weight_decay=1e-4,
                                  lr_policy='fixed', max_iter=1 << 30, display=0, random_seed=1)
    p.net_param.CopyFrom(net)
    return p


def build(devices, sync_bn, cfg, batch_source):
    from caffe_syncbn.training.solvers import get_solver
    net = resnet_param(cfg['batch'] // devices, cfg['size'], cfg['width'], cfg['blocks'])
    solver = get_solver(solver_param(net), devices='cpu:%d' % devices, sync_bn=sync_bn)
    solver.set_data_source(batch_source)
    return solver


def timed_rounds(solvers, warmup, steps):
    """Step every solver once per round (rotating who goes first); median s/step each."""
    times = {name: [] for name in solvers}
    names = list(solvers)
    for round_index in range(warmup + steps):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            solvers[name].step(1)
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--quick', action='store_true', help='a tiny net and few steps (CI)')
    for key, value in FULL.items():
        p.add_argument('--' + key, type=int, help='default %d (quick: %d)' % (value, QUICK[key]))
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    cfg.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
    if cfg['batch'] % 4 or cfg['batch'] < 4:
        raise CaffeError('--batch must be a positive multiple of 4 (it is split over 1, 2 '
                         'and 4 devices), got %d' % cfg['batch'])
    if min(cfg['steps'], cfg['size'], cfg['width'], cfg['blocks']) < 1 or cfg['warmup'] < 0:
        raise CaffeError('--steps, --size, --width and --blocks must be at least 1')
    rng = np.random.RandomState(0)
    batch = {'data': rng.randn(cfg['batch'], 3, cfg['size'], cfg['size']).astype(np.float32),
             'label': rng.randint(0, CLASSES, cfg['batch']).astype(np.float32)}
    source = lambda: batch  # noqa: E731  (the same global batch every step)
    configs = {'BN x2': (2, False), 'SyncBN x2': (2, True), 'BN x4': (4, False),
               'SyncBN x4': (4, True), 'SyncBN x1': (1, True)}
    solvers = {}
    try:
        for name, (devices, sync_bn) in configs.items():
            solvers[name] = build(devices, sync_bn, cfg, source)
        bn_layers = sum(layer.type == 'SyncBN' for layer in solvers['SyncBN x2'].net.layers)
        print('net: ResNet-style, %d BN layers, %d blocks/stage, width %d, input 3x%dx%d; '
              'global batch %d; median of %d steps after %d warm-up'
              % (bn_layers, cfg['blocks'], cfg['width'], cfg['size'], cfg['size'],
                 cfg['batch'], cfg['steps'], cfg['warmup']))
        print('machine: %d CPU cores, OPENBLAS_NUM_THREADS=%s; load average %.2f %.2f %.2f'
              % (os.cpu_count(), os.environ['OPENBLAS_NUM_THREADS'], *os.getloadavg()))
        median = timed_rounds(solvers, cfg['warmup'], cfg['steps'])
    finally:
        for solver in solvers.values():
            solver.close()
    for devices in (2, 4):
        bn, sync = median['BN x%d' % devices], median['SyncBN x%d' % devices]
        print('%d virtual CPU devices, %d images each: per-device BN %.1f ms/step, SyncBN %.1f '
              'ms/step' % (devices, cfg['batch'] // devices, bn * 1e3, sync * 1e3))
        print('SyncBN / BN step time: %.3fx (%d devices%s)' % (
            sync / bn, devices, ', target <= 1.05x' if devices == 2 else ''))
    print('SyncBN scaling at global batch %d:' % cfg['batch'])
    print('  devices  ms/step  images/s  speed-up')
    for devices in (1, 2, 4):
        seconds = median['SyncBN x%d' % devices]
        print('  %7d  %7.1f  %8.1f  %7.2fx' % (devices, seconds * 1e3, cfg['batch'] / seconds,
                                               median['SyncBN x1'] / seconds))
    return 0


if __name__ == '__main__':
    run_main(main)
