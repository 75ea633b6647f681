#!/usr/bin/env python3
"""Winograd F(2x2, 3x3) against im2col, layer by layer, in one process.

    python benchmarks/winograd.py [--sets resnet20-b1,resnet20-b32,resnet50-b2,vgg-b1]
                                  [--rounds 5] [--threads 2]

For every distinct shape of the 3x3 stride-1 convolutions that Winograd can run in each
set (ResNet-20 CIFAR at batch 1 and 32, ResNet-50 at batch 2, the 3x3 layers of VGG-16 at
224 x 224 and batch 1), it builds the layer alone (float32, filler weights, random input)
and times forward and backward (input and weight gradients) with each engine forced by
CAFFE_SYNCBN_WINOGRAD, the engines alternating within each of --rounds rounds (which goes
first alternates too). It prints the medians, the ratios Winograd / im2col of forward,
backward and forward+backward, the engine that the rule (``winograd_cpu.pays``) picks,
and per set the sums over its layers (each shape times its count in the net), for all
the layers and for those the rule gives Winograd; then the load average.
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..'))

VGG16 = [(3, 64, 224), (64, 64, 224), (64, 128, 112), (128, 128, 112), (128, 256, 56),
         (256, 256, 56), (256, 256, 56), (256, 512, 28), (512, 512, 28), (512, 512, 28),
         (512, 512, 14), (512, 512, 14), (512, 512, 14)]
SETS = {'resnet20-b1': (os.path.join(HERE, 'nets', 'resnet20_cifar_deploy.prototxt'), 1),
        'resnet20-b32': (os.path.join(HERE, 'nets', 'resnet20_cifar_deploy.prototxt'), 32),
        'resnet50-b2': (os.path.join(HERE, '..', 'examples', 'resnet50',
                                     'ResNet-50-deploy.prototxt'), 2),
        'vgg-b1': (None, 1)}


def layer_text(channels_out, pad, group, bias):
    return ('name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param { '
            'num_output: %d kernel_size: 3 pad: %d group: %d bias_term: %s '
            'weight_filler { type: "msra" } bias_filler { type: "constant" value: 0.1 } }'
            % (channels_out, pad, group, 'true' if bias else 'false'))


def shapes_of(name):
    """{(N, C, H, W, K, pad, group, bias): count} of the set's Winograd-able layers."""
    from caffe_syncbn import TRAIN, Net
    from caffe_syncbn.analysis.timing import timing_net_param
    path, batch = SETS[name]
    found = {}
    if path is None:
        for c, k, size in VGG16:
            key = (batch, c, size, size, k, 1, 1, True)
            found[key] = found.get(key, 0) + 1
        return found
    net = Net(timing_net_param(path, batch), TRAIN)
    for name, layer in zip(net._layer_names, net.layers):      # pycaffe's names
        if layer.type == 'Convolution' and getattr(layer, 'winograd', False):
            n, c, h, w = net.blobs[net.bottom_names[name][0]].shape
            cp = layer.param.convolution_param
            key = (n, c, h, w, layer.num_output, layer.pad[0], layer.group, cp.bias_term)
            found[key] = found.get(key, 0) + 1
    return found


def time_layer(key, rounds):
    """{engine: (forward s, backward s)} medians, and whether the rule picks Winograd."""
    import numpy as np
    from caffe_syncbn.layers.conv import host, host_winograd as winograd_cpu
    from caffe_syncbn.testing import build_layer
    n, c, h, w, k, pad, group, bias = key
    x = np.random.RandomState(0).standard_normal((n, c, h, w)).astype(np.float32)
    layer, bottom, top = build_layer(layer_text(k, pad, group, bias), [x], dtype=np.float32)
    top[0].diff[...] = np.random.RandomState(1).standard_normal(top[0].shape)
    os.environ.pop(winograd_cpu.MODE_VARIABLE, None)
    picks = host.runs(layer) is winograd_cpu

    def once():
        t0 = time.perf_counter()
        layer.forward(bottom, top)
        t1 = time.perf_counter()
        layer.backward(top, [True], bottom)
        return t1 - t0, time.perf_counter() - t1

    times = {'on': [], 'off': []}
    for engine in times:                      # warm-up: buffers, thread pool
        os.environ[winograd_cpu.MODE_VARIABLE] = engine
        once()
    first = sum(once())
    reps = max(1, int(0.05 / max(first, 1e-6)))
    for r in range(rounds):
        for engine in (('on', 'off') if r % 2 == 0 else ('off', 'on')):
            os.environ[winograd_cpu.MODE_VARIABLE] = engine
            runs = [once() for _ in range(reps)]
            times[engine].append(tuple(sum(t[i] for t in runs) / reps for i in (0, 1)))
    os.environ.pop(winograd_cpu.MODE_VARIABLE, None)
    return {e: tuple(statistics.median(t[i] for t in ts) for i in (0, 1))
            for e, ts in times.items()}, picks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--sets', default=','.join(SETS))
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--threads', type=int, default=2)
    args = parser.parse_args(argv)
    for variable in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS'):
        os.environ[variable] = str(args.threads)      # before numpy loads its BLAS
    print('%d threads, %d rounds; load average %.2f %.2f %.2f'
          % (args.threads, args.rounds, *os.getloadavg()))
    for name in args.sets.split(','):
        print('\n%s: N C HxW K pad group, count | im2col fwd bwd ms | Winograd / im2col: '
              'fwd bwd fwd+bwd | rule' % name)
        sums = {'all': [0.0] * 4, 'rule': [0.0] * 4}
        for key, count in sorted(shapes_of(name).items(), key=lambda kv: kv[0][1:]):
            medians, picks = time_layer(key, args.rounds)
            (wf, wb), (cf, cb) = medians['on'], medians['off']
            print('  %3d %4d %3dx%-3d %4d %d %d x%-2d | %8.2f %8.2f | %.3f %.3f %.3f | %s'
                  % (key[0], key[1], key[2], key[3], key[4], key[5], key[6], count,
                     cf * 1e3, cb * 1e3, wf / cf, wb / cb, (wf + wb) / (cf + cb),
                     'winograd' if picks else 'im2col'))
            for part in ('all', 'rule') if picks else ('all',):
                for i, value in enumerate((wf, wb, cf, cb)):
                    sums[part][i] += value * count
        for part, (wf, wb, cf, cb) in sums.items():
            if cf:
                print('  sum over %s layers: im2col %.1f ms; Winograd / im2col: fwd %.3f '
                      'bwd %.3f fwd+bwd %.3f' % ('the rule\'s Winograd' if part == 'rule'
                                                 else 'all', (cf + cb) * 1e3, wf / cf,
                                                 wb / cb, (wf + wb) / (cf + cb)))
    print('load average after %.2f %.2f %.2f' % os.getloadavg())
    return 0


if __name__ == '__main__':
    sys.exit(main())
