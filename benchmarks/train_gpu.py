#!/usr/bin/env python3
"""Training throughput of ResNet-50: images/s of caffe_syncbn against PyTorch in the same run.

    PYTHONPATH=. python3 benchmarks/train_gpu.py [--devices gpu:0] [--batch 8] [--sync-bn]

(from the repository root). The net is examples/resnet50/ResNet-50-deploy.prototxt turned
into a TRAIN net: Input tops 'data' (batch x 3 x size x size) and 'label', BatchNorm with
batch statistics, SoftmaxWithLoss instead of the final Softmax, MSRA/Xavier fillers (the
deploy file has none, so every weight would be zero). It trains with SGD (lr 0.01, momentum
0.9, weight decay 1e-4) through training.get_solver on --devices, fed one fixed random
global batch; --sync-bn turns BatchNorm+Scale into SyncBN first. Each figure is the median
of --iters timed solver.step(1) calls after --warmup untimed ones, every GPU synchronized
before the clock is read.

The reference, when torch imports and sees a GPU, is the same ResNet-50 written in plain
torch.nn (torchvision is not needed), trained with the same optimizer, batch and steps on
the first GPU of --devices, in fp32 (TF32 off, as CuPy's GEMMs are fp32) with cuDNN
autotuning. Target: ours >= 0.9x torch's images/s.

On the CPU it is a smoke test, e.g. --devices cpu:1 --batch 2 --iters 1 --warmup 1 --size 64.
At a --size other than 224, res5 is not 7 x 7, so pool5 becomes a global average pool.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)

from caffe_syncbn import caffe_pb2  # noqa: E402
from caffe_syncbn.backend import get_array_module  # noqa: E402
from caffe_syncbn.cli.common import run_main  # noqa: E402
from caffe_syncbn.errors import CaffeError  # noqa: E402
from caffe_syncbn.training.device_names import parse_devices  # noqa: E402

MODEL = os.path.join(ROOT, 'examples', 'resnet50', 'ResNet-50-deploy.prototxt')
CLASSES = 1000
TARGET = 0.9


# ---- caffe_syncbn ----------------------------------------------------------------------------
def train_net_param(local_batch, size, sync_bn):
    """The deploy ResNet-50 as a TRAIN net for ``local_batch`` images per device."""
    from caffe_syncbn.convert import to_syncbn
    from caffe_syncbn.netparam.upgrade import load_net_param
    net = load_net_param(MODEL)
    for layer in net.layer:
        if layer.type == 'Input':       # per device: each replica's Input holds its slice
            layer.ClearField('top')
            layer.top.extend(['data', 'label'])
            layer.input_param.ClearField('shape')
            layer.input_param.shape.add(dim=[local_batch, 3, size, size])
            layer.input_param.shape.add(dim=[local_batch])
        elif layer.type == 'BatchNorm':
            layer.batch_norm_param.ClearField('use_global_stats')
        elif layer.type == 'Convolution':
            layer.convolution_param.weight_filler.type = 'msra'
        elif layer.type == 'InnerProduct':
            layer.inner_product_param.weight_filler.type = 'xavier'
        elif layer.type == 'Pooling' and layer.name == 'pool5' and size != 224:
            layer.pooling_param.ClearField('kernel_size')
            layer.pooling_param.global_pooling = True
        elif layer.type == 'Softmax' and layer.name == 'prob':
            layer.name, layer.type = 'loss', 'SoftmaxWithLoss'
            layer.bottom.append('label')
            layer.top[:] = ['loss']
    return to_syncbn(net)[0] if sync_bn else net


def make_solver(args, replicas):
    from caffe_syncbn.training.solvers import get_solver
    param = caffe_pb2.SolverParameter(type='SGD', base_lr=0.01, momentum=0.9, weight_decay=1e-4,
                                      lr_policy='fixed', max_iter=1 << 30, display=0,
                                      random_seed=1)
    param.net_param.CopyFrom(train_net_param(args.batch // replicas, args.size, args.sync_bn))
    return get_solver(param, devices=args.devices)


def synchronizer(solver):
    """A function that waits for every GPU the solver's replicas use (a no-op on the CPU):
    steps only enqueue kernels, so the clock is read after the devices are idle."""
    xp = get_array_module(solver.net.learnable_params[0].data)
    if xp is np:
        return lambda: None
    gpus = sorted({index for _, index in solver.devices})

    def synchronize():
        for index in gpus:
            xp.cuda.Device(index).synchronize()
    return synchronize


def time_ours(args, batch, replicas):
    solver = make_solver(args, replicas)
    try:
        solver.set_data_source(lambda: batch)
        return median_step(lambda: solver.step(1), synchronizer(solver), args.warmup, args.iters)
    finally:
        solver.close()


# ---- the PyTorch reference -------------------------------------------------------------------
def torch_resnet50(torch):
    """ResNet-50 as the MSRA prototxt has it: bottleneck v1 with the stride on the first 1x1,
    a biased conv1, a ceil-mode 3x3/2 max pool, global average pool, fc 1000."""
    nn = torch.nn

    def conv_bn(cin, cout, kernel, stride=1, relu=True):
        layers = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False),
                  nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, nn.ReLU(inplace=True)) if relu else nn.Sequential(*layers)

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            self.branch2 = nn.Sequential(conv_bn(cin, width, 1, stride), conv_bn(width, width, 3),
                                         conv_bn(width, 4 * width, 1, relu=False))
            self.branch1 = (conv_bn(cin, 4 * width, 1, stride, relu=False)
                            if stride != 1 or cin != 4 * width else nn.Identity())
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.relu(self.branch2(x) + self.branch1(x))

    blocks, cin = [], 64
    for stage, (width, count) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for block in range(count):
            blocks.append(Bottleneck(cin, width, 2 if stage > 0 and block == 0 else 1))
            cin = 4 * width
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                         nn.MaxPool2d(3, 2, ceil_mode=True), *blocks,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, CLASSES))


def import_torch_gpu(devices):
    """(torch, None) when the reference can run, else (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, 'torch is not installed'
    if not torch.cuda.is_available():
        return None, 'torch sees no CUDA device'
    if devices[0][0] != 'gpu':
        return None, 'the devices are not GPUs'
    return torch, None


def time_torch(torch, args, batch, gpu):
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False            # fp32 against fp32
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device('cuda', gpu)
    model = torch_resnet50(torch).to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    # Host arrays copied in every step, as the solver's data source is.
    x, y = torch.from_numpy(batch['data']), torch.from_numpy(batch['label'].astype(np.int64))

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x.to(device)), y.to(device)).backward()
        optimizer.step()

    return median_step(step, lambda: torch.cuda.synchronize(device), args.warmup, args.iters)


# ---- timing and output -----------------------------------------------------------------------
def median_step(step, synchronize, warmup, iters):
    """Median seconds of one ``step`` over ``iters`` timed calls after ``warmup`` untimed."""
    for _ in range(warmup):
        step()
    synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_name(devices):
    if devices[0][0] == 'cpu':
        return 'CPU, %d cores' % os.cpu_count()
    import cupy
    return cupy.cuda.runtime.getDeviceProperties(devices[0][1])['name'].decode()


def report(name, seconds, batch):
    print('%-14s %7.1f ms/step %7.1f images/s' % (name, seconds * 1e3, batch / seconds))
    return batch / seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--devices', default='gpu:0', help="e.g. gpu:0, gpu:0,0, gpu:0,1, cpu:1")
    p.add_argument('--batch', type=int, default=8, help='global batch, split over the devices')
    p.add_argument('--size', type=int, default=224, help='input height and width')
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--iters', type=int, default=10)
    p.add_argument('--sync-bn', action='store_true', help='BatchNorm+Scale -> SyncBN')
    args = p.parse_args(argv)
    devices = parse_devices(args.devices)
    if args.batch < 1 or args.batch % len(devices):
        raise CaffeError('--batch must be a positive multiple of the %d devices, got %d'
                         % (len(devices), args.batch))
    if args.iters < 1 or args.warmup < 0 or args.size < 32:
        raise CaffeError('--iters must be >= 1, --warmup >= 0 and --size >= 32')
    rng = np.random.RandomState(0)
    batch = {'data': rng.standard_normal((args.batch, 3, args.size, args.size)).astype(np.float32),
             'label': rng.randint(0, CLASSES, args.batch).astype(np.float32)}
    print('net: ResNet-50 (%s), TRAIN, %s, input 3x%dx%d; global batch %d; median of %d steps '
          'after %d warm-up' % (os.path.basename(MODEL), 'SyncBN' if args.sync_bn else 'BatchNorm',
                                args.size, args.size, args.batch, args.iters, args.warmup))
    print('devices: %s (%s)' % (args.devices, device_name(devices)))
    ours = report('caffe_syncbn', time_ours(args, batch, len(devices)), args.batch)
    torch, why_not = import_torch_gpu(devices)
    if torch is None:
        print('torch reference was skipped: %s' % why_not)
        return 0
    theirs = report('torch', time_torch(torch, args, batch, devices[0][1]), args.batch)
    print('ratio (ours / torch): %.2fx (target >= %.1fx)' % (ours / theirs, TARGET))
    return 0


if __name__ == '__main__':
    run_main(main)
