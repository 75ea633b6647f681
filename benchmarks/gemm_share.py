#!/usr/bin/env python3
"""How much of a TRAIN step is GEMM, and how close its GEMMs run to the core's peak.

    python benchmarks/gemm_share.py PROTOTXT [--batch N] [--iterations K] [--threads T]

Times every call of numpy.matmul in --iterations forward+backward passes (after one
warm-up; the numpy layers' GEMMs go through it, the ``@`` operator would not be seen) and
counts its multiply-adds, then times the largest of those GEMM shapes alone, on one
core, as the peak to compare with. With --threads 1 (the default) the GEMM time is the
time of the step that no other work can shorten: the rest (im2col and col2im, the
elementwise layers, the accumulation of gradients) is what an implementation controls.
The GEMMs of threads other than the calling one are not seen, so use --threads 1.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))


class GemmMeter:
    """Wraps numpy.matmul, which the numpy layers look up at each call: multiply-adds,
    seconds and shapes of every GEMM while ``active``."""

    def __init__(self, np):
        self.np, self.matmul = np, np.matmul
        self.macs, self.seconds, self.shapes, self.active = 0, 0.0, {}, False
        np.matmul = self

    def __call__(self, a, b, *args, **kwargs):
        start = time.perf_counter()
        result = self.matmul(a, b, *args, **kwargs)
        if self.active:
            self.seconds += time.perf_counter() - start
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            macs = result.size * k
            self.macs += macs
            key = (m, k, n, a.dtype.name)
            self.shapes[key] = self.shapes.get(key, 0) + macs
        return result

    def close(self):
        self.np.matmul = self.matmul


def peak_rate(np, shapes, seconds=0.3):
    """Multiply-adds per second of the shape with the most multiply-adds, timed alone."""
    (m, k, n, dtype), _ = max(shapes.items(), key=lambda item: item[1])
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(dtype) for s in ((m, k), (k, n)))
    out = np.empty((m, n), dtype)
    np.matmul(a, b, out=out)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        np.matmul(a, b, out=out)
        calls += 1
    return calls * m * k * n / (time.perf_counter() - start), (m, k, n)


def measure(args):
    import numpy as np

    from caffe_syncbn import TRAIN, Net
    from caffe_syncbn.analysis.timing import time_net, timing_net_param
    meter = GemmMeter(np)
    try:
        net = Net(timing_net_param(args.model, args.batch), TRAIN)
        time_net(net, 1)
        meter.active = True
        step = time_net(net, args.iterations, warmup=0)['total']
        meter.active = False
        rate, shape = peak_rate(np, meter.shapes)
    finally:
        meter.close()
    gemm = meter.seconds / args.iterations
    macs = meter.macs / args.iterations
    print('%s, batch %s, TRAIN forward+backward, %d thread(s)'
          % (args.model, args.batch or "as the prototxt says", args.threads))
    print('step                 %8.1f ms' % (step * 1e3))
    print('GEMMs                %8.1f ms  (%.0f %% of the step), %.4g G multiply-adds, '
          '%.1f G/s' % (gemm * 1e3, 100 * gemm / step, macs / 1e9, macs / gemm / 1e9))
    print('the rest             %8.1f ms' % ((step - gemm) * 1e3))
    print('peak, %dx%dx%d alone  %.1f G multiply-adds/s: the GEMMs at that rate take %.1f ms'
          % (shape + (rate / 1e9, macs / rate * 1e3)))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('model', help='net prototxt')
    parser.add_argument('--batch', type=int, default=None,
                        help="batch size of every input (default: the prototxt's)")
    parser.add_argument('--iterations', type=int, default=3)
    parser.add_argument('--threads', type=int, default=1)
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.threads < 1:
        parser.error('--iterations and --threads must be at least 1')
    os.environ['CAFFE_SYNCBN_THREADS'] = str(args.threads)   # before the layers start
    from caffe_syncbn.cli.common import run_main
    run_main(lambda: measure(args))


if __name__ == '__main__':
    main()
