"""benchmarks/train_gpu.py runs as a CPU smoke test: ResNet-50 trains and the output has a
throughput, and says why the torch reference was skipped."""
import re
import sys

from helpers import watchdog

from helpers.paths import ROOT


def test_train_gpu_benchmark_cpu_smoke():
    result = watchdog.run(
        [sys.executable, str(ROOT / 'benchmarks' / 'train_gpu.py'), '--devices', 'cpu:1',
         '--batch', '2', '--iters', '1', '--warmup', '1', '--size', '64'],
        capture_output=True, text=True, limit=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    speed = re.search(r'^caffe_syncbn +[\d.]+ ms/step +([\d.]+) images/s$', out, re.MULTILINE)
    assert speed and float(speed.group(1)) > 0, out
    assert re.search(r'^torch reference was skipped: \S', out, re.MULTILINE), out
