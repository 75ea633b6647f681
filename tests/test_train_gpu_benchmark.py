"""benchmarks/train_gpu.py runs as a CPU smoke test: ResNet-50 trains and the output has a
throughput, names the convolution engine, and says why the torch reference was skipped; its
header is the one that gpu-check's resnet50 note reads. --engine sets CAFFE_SYNCBN_CUDNN
before any net is built, and the cuDNN engine is refused on CPU devices in one line."""
import os
import re
import sys
import types

import numpy as np
import pytest
from helpers import fake_cudnn, watchdog
from helpers.arrays import randn
from helpers.engines import Engine
from helpers.layer_cases import convolution

from caffe_syncbn.backend import device
from helpers.paths import ROOT

sys.path.insert(0, str(ROOT / 'tools'))
sys.path.insert(0, str(ROOT / 'benchmarks'))

import gpu_check  # noqa: E402
import train_gpu  # noqa: E402

BENCHMARK = str(ROOT / 'benchmarks' / 'train_gpu.py')


def test_train_gpu_benchmark_cpu_smoke():
    result = watchdog.run(
        [sys.executable, BENCHMARK, '--devices', 'cpu:1', '--batch', '2', '--iters', '1',
         '--warmup', '1', '--size', '64', '--engine', 'im2col'],
        capture_output=True, text=True, limit=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r'^net: ResNet-50 .*; TF32 off; engine im2col$', out, re.MULTILINE), out
    speed = re.search(r'^caffe_syncbn +[\d.]+ ms/step +([\d.]+) images/s$', out, re.MULTILINE)
    assert speed and float(speed.group(1)) > 0, out
    assert re.search(r'^torch reference was skipped: \S', out, re.MULTILINE), out
    check = types.SimpleNamespace(results=[], outputs={'resnet50': out})
    assert gpu_check.resnet50_ratios(check)[1] == (
        'no ratios against torch: torch was skipped or a run failed; no cudnn runs: '
        'cudnn-tests did not pass in this run')


class NetBuilt(Exception):
    """Raised where the benchmark builds its first net: the test has seen what it needs."""


@pytest.mark.parametrize('flags, expected', [([], '0'), (['--engine', 'im2col'], '0'),
                                             (['--engine', 'cudnn'], '1')])
def test_the_engine_is_chosen_before_any_net_is_built(flags, expected, monkeypatch):
    monkeypatch.setenv('CAFFE_SYNCBN_CUDNN', '1' if expected == '0' else '0')  # the other one
    monkeypatch.delenv('CUPY_TF32', raising=False)          # main() sets it: put back after
    seen = []

    def first_net(args, local_batch):
        seen.append(os.environ['CAFFE_SYNCBN_CUDNN'])
        raise NetBuilt
    monkeypatch.setattr(train_gpu, 'parse_devices', lambda text: [('gpu', 0)])
    monkeypatch.setattr(train_gpu, 'train_net_param', first_net)
    with pytest.raises(NetBuilt):
        train_gpu.main(['--devices', 'gpu:0', '--batch', '2'] + flags)
    assert seen == [expected]


def test_the_cudnn_engine_on_cpu_devices_is_one_error_line():
    result = watchdog.run([sys.executable, BENCHMARK, '--devices', 'cpu:1', '--engine', 'cudnn'],
                          capture_output=True, text=True, limit=120)
    assert result.returncode == 1 and result.stdout == ''
    assert result.stderr == 'error: --engine cudnn runs on GPUs: --devices gpu:N, got cpu:1\n'
    unknown = watchdog.run([sys.executable, BENCHMARK, '--engine', 'cublas'],
                           capture_output=True, text=True, limit=120)
    assert unknown.returncode == 2
    assert "invalid choice: 'cublas'" in unknown.stderr.strip().splitlines()[-1]


def test_the_output_says_how_many_convolutions_ran_on_cudnn(monkeypatch, capsys):
    """So that a figure of --engine cudnn cannot be im2col's unawares: here one of two
    convolutions asks for im2col, and one of its passes has no cuDNN plan."""
    engine = Engine('cuda-emulated', monkeypatch)
    with fake_cudnn.installed(monkeypatch, device.RUNTIMES['gpu']) as fake:
        fake.refused = {'wgrad'}
        layers = [engine.build(convolution('num_output: 2 kernel_size: 3 %s' % extra),
                               [randn(1, 2, 5, 5)], dtype=np.float32)[0]
                  for extra in ('', 'engine: CAFFE')]
        engine.run(convolution('num_output: 2 kernel_size: 3 stride: 2'), [randn(1, 2, 5, 6)],
                   dtype=np.float32)
        train_gpu.print_engine_use(types.SimpleNamespace(layers=layers))
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(r'cuDNN engine: 1 of 2 convolution layers; [1-9]\d* pass geometries '
                        r'without a cuDNN plan \(they ran im2col\)', line), line
