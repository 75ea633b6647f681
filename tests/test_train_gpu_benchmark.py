"""benchmarks/train_gpu.py runs as a CPU smoke test: ResNet-50 trains and the output has a
throughput, names the convolution engine, and says why the torch reference was skipped; its
header is the one that gpu-check's resnet50 note reads. --engine sets CAFFE_SYNCBN_CUDNN
before any net is built, and the cuDNN engine is refused on CPU devices in one line."""
import os
import re
import sys
import types

import pytest
from helpers import watchdog

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
