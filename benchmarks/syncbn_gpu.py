"""SyncBN forward and backward on one GPU: achieved bandwidth against a device-to-device copy,
and the time against torch.nn.BatchNorm2d (cuDNN) in the same run when torch imports.

    python benchmarks/syncbn_gpu.py [--repeats 15] [--shapes 8x256x128x128,...]

For each shape (N, C, H, W), dtype (float32, float16) and replica count (1, and 4 replicas
on the same GPU splitting the batch, joined by SameDeviceComm), it times the fused SyncBN
forward (ideal traffic: 3 passes over x: read for the statistics, read and write y) and
backward (5 passes: read x and dy for the sums, read them again and write dx), and prints
the achieved GB/s as a fraction of the copy bandwidth (a D2D memcpy of x, 2 passes).
Targets: >= 85% of copy bandwidth, and faster than torch's BN.
Timing: CUDA events, warm-up runs, the median over repeats.
"""
import argparse
import os
import statistics
import sys
import threading

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

SHAPES = ((8, 256, 128, 128), (32, 64, 56, 56), (2, 2048, 60, 60))
DTYPES = (np.float32, np.float16)
REPLICAS = (1, 4)


def require_gpu():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError('no CUDA device')
        return cupy
    except Exception as exc:    # ImportError, or a CUDA runtime error without a driver/device
        sys.exit('syncbn_gpu benchmark needs an NVIDIA GPU with CuPy: %s' % exc)


_SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}'''
HOLD_MS = 50


def hold(cupy, stream, ms=HOLD_MS):
    """Keep ``stream`` busy for about ``ms`` (one thread spinning on the clock): the work the
    threads enqueue behind it meanwhile then runs back to back, and the events around it
    time the GPU, not Python launching threads and kernels."""
    clock_khz = cupy.cuda.Device().attributes['ClockRate']
    with stream:
        cupy.RawKernel(_SPIN, 'spin')((1,), (1,), (np.int64(ms * clock_khz),))


def elapsed_ms(cupy, start, end):
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end)


class Replica:
    """One replica's SyncBN layer and its input/gradient buffers, on its own stream."""

    def __init__(self, cupy, shape, dtype, comm):
        from caffe_syncbn.blob import Blob
        from caffe_syncbn.layer import TRAIN, LayerContext, create_layer
        from caffe_syncbn.testing import layer_param
        text = 'name: "bn" type: "SyncBN" bottom: "x" top: "y" bn_param { momentum: 0.9 }'
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.layer = create_layer(layer_param(text), LayerContext(
                phase=TRAIN, xp=cupy, dtype=dtype, comm=comm))
            self.bottom, self.top = [Blob(shape, dtype, cupy)], [Blob(shape, dtype, cupy)]
            self.layer.setup(self.bottom, self.top)
            self.layer.blobs[0].data[...] = 1
            rs = cupy.random.RandomState(0)
            self.bottom[0].data[...] = rs.standard_normal(shape, np.float32).astype(dtype)
            self.layer.reshape(self.bottom, self.top)
            self.top[0].diff[...] = rs.standard_normal(shape, np.float32).astype(dtype)

    def forward(self):
        self.layer.forward(self.bottom, self.top)

    def backward(self):
        self.layer.backward(self.top, [True], self.bottom)


def time_replicas(cupy, replicas, step, iters, repeats):
    """Median ms of one `step` on every replica: each replica's thread enqueues `iters` steps
    on its stream between events joined on a coordinating stream."""
    coordinator = cupy.cuda.Stream(non_blocking=True)
    samples = []
    for sample in range(repeats + 2):             # the first two are warm-up
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        hold(cupy, coordinator)
        start.record(coordinator)
        ends = [None] * len(replicas)

        def run(r):
            replica = replicas[r]
            with replica.stream:
                replica.stream.wait_event(start)
                for _ in range(iters):
                    getattr(replica, step)()
                ends[r] = replica.stream.record()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in ends:
            coordinator.wait_event(e)
        end.record(coordinator)
        if sample >= 2:
            samples.append(elapsed_ms(cupy, start, end) / iters)
    return statistics.median(samples)


def copy_ms(cupy, x, iters, repeats):
    dst = cupy.empty_like(x)
    stream = cupy.cuda.Stream(non_blocking=True)
    samples = []
    for sample in range(repeats + 2):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        hold(cupy, stream)
        start.record(stream)
        for _ in range(iters):
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, x.data.ptr, x.nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
        end.record(stream)
        if sample >= 2:
            samples.append(elapsed_ms(cupy, start, end) / iters)
    return statistics.median(samples)


def torch_ms(shape, dtype, iters, repeats):
    """(forward ms, backward ms) of torch.nn.BatchNorm2d in training mode, or None."""
    try:
        import torch
    except ImportError:
        return None
    dev = torch.device('cuda')
    tdtype = torch.float16 if dtype == np.float16 else torch.float32
    bn = torch.nn.BatchNorm2d(shape[1]).to(dev).train()
    x = torch.randn(shape, device=dev, dtype=tdtype, requires_grad=True)
    dy = torch.randn(shape, device=dev, dtype=tdtype)
    y = bn(x)

    def measure(fn):
        samples = []
        for sample in range(repeats + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            if sample >= 2:
                samples.append(start.elapsed_time(end) / iters)
        return statistics.median(samples)

    forward = measure(lambda: bn(x))
    backward = measure(lambda: torch.autograd.grad(y, [x, bn.weight, bn.bias], dy,
                                                   retain_graph=True))
    return forward, backward


def split(n, parts):
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--repeats', type=int, default=15)
    parser.add_argument('--iters', type=int, default=10, help='steps per timed sample')
    parser.add_argument('--shapes', default=','.join('x'.join(map(str, s)) for s in SHAPES))
    args = parser.parse_args()
    cupy = require_gpu()
    from caffe_syncbn.comm.same_device import SameDeviceComm
    shapes = [tuple(int(v) for v in s.split('x')) for s in args.shapes.split(',')]
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print('device: %s' % props['name'].decode())
    print('%-18s %-7s %3s | %8s %7s %6s | %8s %7s %6s | %15s %8s' % (
        'shape', 'dtype', 'R', 'fwd ms', 'GB/s', 'copy%', 'bwd ms', 'GB/s', 'copy%',
        'torch fwd/bwd', 'speedup'))
    for shape in shapes:
        for dtype in DTYPES:
            x = cupy.random.standard_normal(shape, np.float32).astype(dtype)
            nbytes = x.nbytes
            copy_bw = 2 * nbytes / copy_ms(cupy, x, args.iters, args.repeats) / 1e6
            del x
            reference = torch_ms(shape, dtype, args.iters, args.repeats)
            for count in REPLICAS:
                comms = SameDeviceComm.create(count, device=cupy.cuda.Device().id) \
                    if count > 1 else [None]
                replicas = [Replica(cupy, (n,) + shape[1:], dtype, comm)
                            for n, comm in zip(split(shape[0], count), comms)]
                fwd = time_replicas(cupy, replicas, 'forward', args.iters, args.repeats)
                bwd = time_replicas(cupy, replicas, 'backward', args.iters, args.repeats)
                fwd_bw, bwd_bw = 3 * nbytes / fwd / 1e6, 5 * nbytes / bwd / 1e6
                versus = ('%6.3f/%-6.3f %7.2fx' % (reference[0], reference[1],
                                                   (reference[0] + reference[1]) / (fwd + bwd))
                          if reference else '%15s %8s' % ('(no torch)', '-'))
                print('%-18s %-7s %3d | %8.3f %7.0f %5.0f%% | %8.3f %7.0f %5.0f%% | %s' % (
                    'x'.join(map(str, shape)), np.dtype(dtype).name, count, fwd, fwd_bw,
                    100 * fwd_bw / copy_bw, bwd, bwd_bw, 100 * bwd_bw / copy_bw, versus))
                for c in comms:
                    if c is not None:
                        c.close()
                del replicas
                cupy.get_default_memory_pool().free_all_blocks()
            print('%-18s %-7s copy bandwidth %.0f GB/s' % ('', np.dtype(dtype).name, copy_bw))


if __name__ == '__main__':
    main()
