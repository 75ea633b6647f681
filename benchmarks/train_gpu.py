#!/usr/bin/env python3
"""Training throughput of ResNet-50: images/s of caffe_syncbn against PyTorch in the same run.

    PYTHONPATH=. python3 benchmarks/train_gpu.py [--devices gpu:0] [--batch 8] [--sync-bn] [--tf32]
                                                 [--engine im2col|cudnn]
    PYTHONPATH=. python3 benchmarks/train_gpu.py --model NET.prototxt [--memory-plan auto]
    PYTHONPATH=. python3 benchmarks/train_gpu.py --model NET.prototxt --fit off,auto

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
the first GPU of --devices, in fp32 (TF32 off, as CuPy's GEMMs are fp32, unless --tf32)
with cuDNN autotuning. Target: ours >= 0.9x torch's images/s, with --engine cudnn.

--tf32 lets both use TF32 tensor cores for float32 GEMMs and convolutions (CuPy and the cuDNN
engine: CUPY_TF32=1; torch: its allow_tf32 switches). --engine picks how our convolutions run
on GPUs: im2col and a cuBLAS GEMM (the default), or the cuDNN engine (CAFFE_SYNCBN_CUDNN=1, set
before any net is built). On GPUs, each run also prints the peak GPU memory: what CuPy's memory
pool holds after the steps (it keeps every block it once allocated, so this is the most the
replicas held at once, rounded up to its block sizes).

--model NET.prototxt trains another deploy net instead (benchmarks/caffe_reference.as_training:
batch statistics in every batch norm, and a SoftmaxWithLoss against an Input 'label' where it
has none), at the prototxt's input size unless --size is given; the torch reference is
ResNet-50's only. --fit off,auto times nothing: per memory plan, the peak GPU memory of one
step with 1 and with 2 images per replica gives the memory per image, and with the GPU's
free memory the largest batch per replica (linear in the batch, as
examples/segmentation/memory_fit.py estimates it on the CPU).

On the CPU it is a smoke test, e.g. --devices cpu:1 --batch 2 --iters 1 --warmup 1 --size 64.
At a --size other than 224, res5 is not 7 x 7, so pool5 becomes a global average pool.
"""
import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, ROOT)

from caffe_syncbn import caffe_pb2  # noqa: E402
from caffe_syncbn.backend import cudnn_conv, get_array_module  # noqa: E402
from caffe_syncbn.cli.common import run_main  # noqa: E402
from caffe_syncbn.errors import CaffeError  # noqa: E402
from caffe_syncbn.layers.conv import gpu_cudnn  # noqa: E402
from caffe_syncbn.memory_planner import DEFAULT_PLAN, MEMORY_PLANS  # noqa: E402
from caffe_syncbn.training.device_names import parse_devices  # noqa: E402

MODEL = os.path.join(ROOT, 'examples', 'resnet50', 'ResNet-50-deploy.prototxt')
CLASSES = 1000
TARGET = 0.9
ENGINES = ('im2col', 'cudnn')
MIB = 1024.0 * 1024.0


# ---- caffe_syncbn ----------------------------------------------------------------------------
def train_net_param(args, local_batch):
    """The TRAIN net for ``local_batch`` images per device: ResNet-50's, or --model's."""
    from caffe_syncbn.convert import to_syncbn
    net = resnet50_train_param(local_batch, args.size or 224) if args.model == MODEL \
        else model_train_param(args.model, local_batch, args.size)
    return to_syncbn(net)[0] if args.sync_bn else net


def resnet50_train_param(local_batch, size):
    """The deploy ResNet-50 as a TRAIN net for ``local_batch`` images per device."""
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
    return net


def model_train_param(model, local_batch, size):
    """A deploy net as its users train it (caffe_reference.as_training), every Input of
    ``local_batch``, its 4-D inputs ``size`` square when given."""
    from caffe_reference import as_training

    from caffe_syncbn.analysis.timing import timing_net_param
    net = timing_net_param(model, 1, force_backward=False)
    for shape in input_shapes(net):
        if size and len(shape.dim) == 4:
            shape.dim[2:] = [size, size]
    # its label input takes the scores' shape, found by building the net at batch 1
    return with_batch(as_training(net), local_batch)


def input_shapes(net):
    return [shape for layer in net.layer if layer.type == 'Input'
            for shape in layer.input_param.shape]


def with_batch(net, local_batch):
    """A copy of ``net`` whose every Input holds ``local_batch`` images."""
    net = caffe_pb2.NetParameter.FromString(net.SerializeToString())
    for shape in input_shapes(net):
        shape.dim[0] = local_batch
    return net


def global_batch(net, batch, rng):
    """One fixed global batch for the Input layers of ``net`` (a replica's): 'data' standard
    normal; labels (every other input) zeros, which cost the same work as any labels."""
    arrays = {}
    for layer in net.layer:
        for top, shape in zip(layer.top, layer.input_param.shape if layer.type == 'Input' else ()):
            dims = (batch,) + tuple(shape.dim[1:])
            arrays[top] = rng.standard_normal(dims).astype(np.float32) if top == 'data' \
                else np.zeros(dims, np.float32)
    return arrays


def make_solver(net, devices, memory_plan):
    from caffe_syncbn.training.solvers import get_solver
    param = caffe_pb2.SolverParameter(type='SGD', base_lr=0.01, momentum=0.9, weight_decay=1e-4,
                                      lr_policy='fixed', max_iter=1 << 30, display=0,
                                      random_seed=1)
    param.net_param.CopyFrom(net)
    return get_solver(param, devices=devices, memory_plan=memory_plan)


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


def pool_mib(gpus):
    """{GPU: MiB that CuPy's memory pool holds there}. The pool keeps every block it once
    allocated until free_all_blocks, so after the steps this is the most they held at once
    (rounded up to the pool's block sizes)."""
    import cupy
    pool = cupy.get_default_memory_pool()
    held = {}
    for index in gpus:
        with cupy.cuda.Device(index):
            held[index] = pool.total_bytes() / MIB
    return held


def time_ours(net, batch, devices, memory_plan, warmup, iters):
    """(median seconds of a step, {GPU: peak MiB of the steps}, MiB of a replica's params)
    on ``devices`` ('gpu:0,0', ...)."""
    gpus = sorted({index for kind, index in parse_devices(devices) if kind == 'gpu'})
    if gpus:                # blocks that an earlier solver of this process left go back first
        import cupy
        gc.collect()
        for index in gpus:  # the pool hands back the current device's blocks only
            with cupy.cuda.Device(index):
                cupy.get_default_memory_pool().free_all_blocks()
    before = pool_mib(gpus) if gpus else {}
    solver = make_solver(net, devices, memory_plan)
    try:
        solver.set_data_source(lambda: batch)
        seconds = median_step(lambda: solver.step(1), synchronizer(solver), warmup, iters)
        if cudnn_conv.enabled():
            print_engine_use(solver.net)
        peak = {index: mib - before[index] for index, mib in pool_mib(gpus).items()} \
            if gpus else {}
        params = sum(blob.data.nbytes for blob in solver.net.learnable_params) / MIB
        return seconds, peak, params
    finally:
        solver.close()


def print_engine_use(net):
    """How many (de)convolutions the cuDNN engine ran, so that a figure of --engine cudnn
    cannot be im2col's unawares."""
    convolutions = [layer for layer in net.layers if layer.type in ('Convolution',
                                                                    'Deconvolution')]
    on_cudnn = sum(layer.engine is gpu_cudnn for layer in convolutions)
    print('cuDNN engine: %d of %d convolution layers; %d pass geometries without a cuDNN plan '
          '(they ran im2col)' % (on_cudnn, len(convolutions), len(cudnn_conv.unplanned())))


def fit(args, devices):
    """Per plan of --fit: the peak GPU memory of one step with 1 and 2 images per replica,
    and the largest batch per replica that the GPU's free memory holds."""
    if len(devices) != 1 or devices[0][0] != 'gpu':
        raise CaffeError('--fit measures one GPU: --devices gpu:N, got %s' % args.devices)
    import cupy
    gpu = devices[0][1]
    free = cupy.cuda.Device(gpu).mem_info[0] / MIB
    print('free GPU memory before any net: %.0f MiB' % free)
    rng, net = np.random.RandomState(0), train_net_param(args, 1)
    for plan in args.fit:
        peaks = []
        for images in (1, 2):
            net = with_batch(net, images)
            peaks.append(time_ours(net, global_batch(net, images, rng), args.devices, plan,
                                   warmup=0, iters=1)[1][gpu])
        per_image, fixed = peaks[1] - peaks[0], 2 * peaks[0] - peaks[1]
        largest = int((free - fixed) // per_image) if per_image > 0 else 0
        print('fit %-11s peak %8.0f MiB (1 image) %8.0f MiB (2 images): %7.0f MiB per image; '
              'largest batch per GPU: %d' % (plan, peaks[0], peaks[1], per_image, largest),
              flush=True)
    return 0


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
    torch.backends.cudnn.allow_tf32 = args.tf32        # as CuPy's GEMMs (CUPY_TF32)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
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


def plan_list(text):
    plans = text.split(',')
    unknown = [plan for plan in plans if plan not in MEMORY_PLANS]
    if unknown:
        raise argparse.ArgumentTypeError('unknown memory plan %r (known: %s)'
                                         % (unknown[0], ', '.join(MEMORY_PLANS)))
    return plans


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--devices', default='gpu:0', help="e.g. gpu:0, gpu:0,0, gpu:0,1, cpu:1")
    p.add_argument('--batch', type=int, default=8, help='global batch, split over the devices')
    p.add_argument('--size', type=int, help="input height and width (ResNet-50: 224; --model: "
                                            "the prototxt's)")
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--iters', type=int, default=10)
    p.add_argument('--sync-bn', action='store_true', help='BatchNorm+Scale -> SyncBN')
    p.add_argument('--tf32', action='store_true', help='TF32 tensor cores for float32 GEMMs')
    p.add_argument('--model', default=MODEL, help='a deploy prototxt to train instead of ResNet-50')
    p.add_argument('--memory-plan', choices=MEMORY_PLANS, default=DEFAULT_PLAN['pycaffe'],
                   help="the nets' memory plan (default %s, as get_solver's)"
                   % DEFAULT_PLAN['pycaffe'])
    p.add_argument('--fit', type=plan_list, metavar='PLANS',
                   help="time nothing: the largest batch per GPU for each plan (e.g. off,auto)")
    p.add_argument('--engine', choices=ENGINES, default=ENGINES[0],
                   help="our convolutions on GPUs: im2col + cuBLAS GEMM, or cuDNN's (default "
                   '%(default)s)')
    args = p.parse_args(argv)
    # CuPy reads CUPY_TF32 at its first float32 GEMM, so setting it here still counts
    os.environ['CUPY_TF32'] = '1' if args.tf32 else '0'
    devices = parse_devices(args.devices)
    if args.engine == 'cudnn' and devices[0][0] != 'gpu':
        raise CaffeError('--engine cudnn runs on GPUs: --devices gpu:N, got %s' % args.devices)
    os.environ['CAFFE_SYNCBN_CUDNN'] = '1' if args.engine == 'cudnn' else '0'
    if args.batch < 1 or args.batch % len(devices):
        raise CaffeError('--batch must be a positive multiple of the %d devices, got %d'
                         % (len(devices), args.batch))
    if args.iters < 1 or args.warmup < 0 or (args.size or 224) < 32:
        raise CaffeError('--iters must be >= 1, --warmup >= 0 and --size >= 32')
    if args.fit:
        return fit(args, devices)
    net = train_net_param(args, args.batch // len(devices))
    batch = global_batch(net, args.batch, np.random.RandomState(0))
    print('net: %s%s, TRAIN, %s, input %s; global batch %d; median of %d steps after %d '
          'warm-up; memory plan %s; TF32 %s; engine %s' % (
              'ResNet-50 ' if args.model == MODEL else '', os.path.basename(args.model),
              'SyncBN' if args.sync_bn else 'BatchNorm',
              'x'.join(map(str, batch['data'].shape[1:])), args.batch, args.iters, args.warmup,
              args.memory_plan, 'on' if args.tf32 else 'off', args.engine))
    print('devices: %s (%s)' % (args.devices, device_name(devices)))
    seconds, peak, params = time_ours(net, batch, args.devices, args.memory_plan, args.warmup,
                                      args.iters)
    print('batch norms: %d; params: %.1f MiB per replica'
          % (sum(layer.type in ('BatchNorm', 'BN', 'SyncBN') for layer in net.layer), params))
    ours = report('caffe_syncbn', seconds, args.batch)
    for index, mib in sorted(peak.items()):
        print('peak GPU memory: %.0f MiB on gpu %d (CuPy memory pool)' % (mib, index))
    torch, why_not = import_torch_gpu(devices)
    if args.model != MODEL:
        torch, why_not = None, 'the torch reference is ResNet-50 only'
    if torch is None:
        print('torch reference was skipped: %s' % why_not)
        return 0
    theirs = report('torch', time_torch(torch, args, batch, devices[0][1]), args.batch)
    print('ratio (ours / torch): %.2fx (target >= %.1fx)' % (ours / theirs, TARGET))
    return 0


if __name__ == '__main__':
    run_main(main)
