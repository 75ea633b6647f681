"""benchmarks/net_time.py and memory.py run as a user runs them. BVLC Caffe is not in CI:
--compare-caffe is checked against a stand-in that prints `caffe time`'s lines."""
import re
import stat
import subprocess
import sys

from conftest import CORPUS, ROOT, require

LENET = CORPUS / 'BVLC_caffe__examples_mnist_lenet.prototxt'

# `caffe time`'s closing lines, as glog prints them; the stand-in also checks its arguments
FAKE_CAFFE = '''#!%s
import sys
args = sys.argv[1:]
assert args[:2] == ['time', '-model'] and '-iterations' in args, args
text = open(args[2]).read()
assert 'force_backward: true' in text and 'dim: 3' in text, text[:300]
for name in ('conv1', 'pool1', 'ip1'):
    for part in ('forward', 'backward'):
        print('I1123 00:00:00.000000  1 caffe.cpp:400] %%10s\\t%%s: 0.5 ms.' %% (name, part),
              file=sys.stderr)
print('I1123 00:00:00.000000  1 caffe.cpp:408] Average Forward pass: 2.5 ms.', file=sys.stderr)
print('I1123 00:00:00.000000  1 caffe.cpp:410] Average Backward pass: 5 ms.', file=sys.stderr)
print('I1123 00:00:00.000000  1 caffe.cpp:412] Average Forward-Backward: 7.5 ms.', file=sys.stderr)
''' % sys.executable


def run(script, *args):
    result = subprocess.run([sys.executable, str(ROOT / 'benchmarks' / script)] +
                            [str(a) for a in args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_net_time_compares_with_caffe_in_alternating_pairs(tmp_path):
    require(LENET)
    caffe = tmp_path / 'caffe'
    caffe.write_text(FAKE_CAFFE)
    caffe.chmod(caffe.stat().st_mode | stat.S_IEXEC)
    out = run('net_time.py', LENET, '--batch', 3, '--compare-caffe', caffe, '--pairs', 2,
              '--iterations', 1)
    pairs = re.findall(r'^ +([01]) +([\d.]+) +7\.5 +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)$',
                       out, re.M)
    assert [p[0] for p in pairs] == ['0', '1'], out
    for _, ours, ratio, ours_mib, caffe_mib, memory_ratio in pairs:
        # ours prints to 0.05 ms, the ratio to 0.0005
        assert abs(float(ours) - 7.5 * float(ratio)) <= 0.05 + 7.5 * 0.0005
        assert float(ours_mib) > 20 and float(caffe_mib) > 1
        assert abs(float(ours_mib) / float(caffe_mib) / float(memory_ratio) - 1) < 0.01
    assert re.search(r'^RATIO time [\d.]+ memory [\d.]+ \(ours / Caffe, medians of 2 pairs\)',
                     out, re.M), out
    # Caffe's per-layer lines (conv1 only here) are summed by the types of our net's layers
    assert re.search(r'^  Convolution +[\d.]+ +1\.00 ', out, re.M), out


def test_net_time_forward_only_and_memory_report():
    require(LENET)
    out = run('net_time.py', LENET, '--batch', 2, '--phase', 'TEST', '--forward-only',
              '--iterations', 1)
    assert re.search(r'Average Forward pass: [\d.]+ ms\.', out) and 'Peak memory:' in out, out
    out = run('memory.py', LENET, '--batch', 2, '--steps', 1)
    for line in ('after imports:', 'after building:', 'after step 1:', 'params:      data',
                 'activations: data', 'kept by layers'):
        assert line in out, out


def test_gemm_share_counts_every_multiply_add_of_a_step():
    """A TRAIN step of LeNet (forced backward) runs each layer's forward GEMM again as the
    weight gradient and as the bottom gradient: three times the forward's multiply-adds,
    counted here from the layer shapes (conv1 20x1x5x5 over 24x24 outputs, conv2 50x20x5x5
    over 8x8, ip1 800->500, ip2 500->10)."""
    require(LENET)
    out = run('gemm_share.py', LENET, '--iterations', 1)
    per_image = 20 * 25 * 24 * 24 + 50 * 500 * 8 * 8 + 800 * 500 + 500 * 10
    counted = re.search(r'^GEMMs +([\d.]+) ms +\((\d+) % of the step\), ([\d.]+) G', out, re.M)
    assert counted, out
    assert abs(float(counted.group(3)) * 1e9 / (3 * 64 * per_image) - 1) < 1e-3, out
    assert 0 < int(counted.group(2)) <= 100
    assert re.search(r'^peak, \d+x\d+x\d+ alone +[\d.]+ G multiply-adds/s', out, re.M), out
