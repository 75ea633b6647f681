"""benchmarks/net_time.py and memory.py run as a user runs them. BVLC Caffe is not in CI:
--compare-caffe is checked against a stand-in that prints `caffe time`'s lines."""
import pathlib
import re
import stat
import sys

import numpy as np
import pytest
from helpers import watchdog

from helpers.paths import CORPUS, ROOT, require

LENET = CORPUS / 'BVLC_caffe__examples_mnist_lenet.prototxt'
DEMO_NET = ROOT / 'examples' / 'segmentation' / 'fcn_bn.prototxt'

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
    result = watchdog.run([sys.executable, str(ROOT / 'benchmarks' / script)] +
                          [str(a) for a in args], capture_output=True, text=True, limit=300)
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
    out = run('memory.py', LENET, '--batch', 2, '--memory-plan', 'off,share', '--step-rounds', 2)
    times = re.findall(r'^(off|share) +([\d.]+) s +([\d.]+)  \(([\d. ]+)\)$', out, re.M)
    assert [plan for plan, *_ in times] == ['off', 'share'] and times[0][2] == '1.000', out
    assert all(len(steps.split()) == 2 for *_, steps in times), out


@pytest.mark.slow
def test_memory_per_image_of_each_precision():
    """--precision ... --per-image: a process per precision and batch (N, 2N); the memory
    per image is the difference of the peaks over N, and its ratio float32's. The demo's
    net at 64x64 keeps 2.7 MiB per image in float32 (16 more images: 44 MiB, well above the
    peaks' noise), three quarters of it activations and their diffs, which float16 halves
    (measured: 0.74 of float32's)."""
    out = run('memory.py', DEMO_NET, '--input-size', '64,64', '--batch', 16, '--steps', 1,
              '--pairs', 1, '--precision', 'float32,float16', '--per-image')
    rows = re.findall(r'^off +(float32|float16) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)$',
                      out, re.M)
    assert [row[0] for row in rows] == ['float32', 'float16'], out
    per_image = {}
    for precision, peak_n, peak_2n, mib, ratio in rows:
        assert abs((float(peak_2n) - float(peak_n)) / 16 - float(mib)) <= 0.01, out
        per_image[precision] = float(mib)
        assert abs(float(ratio) - float(mib) / per_image['float32']) <= 0.002, out
    assert per_image['float32'] > 2, out
    assert per_image['float16'] < 0.85 * per_image['float32'], out


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


def test_cpu_suite_prints_one_table_of_ratios(tmp_path):
    caffe = tmp_path / 'caffe'
    caffe.write_text(FAKE_CAFFE)
    caffe.chmod(caffe.stat().st_mode | stat.S_IEXEC)
    out = run('cpu_suite.py', '--compare-caffe', caffe, '--nets', 'resnet20-b1', '--pairs', 1,
              '--iterations', 1)
    # the stand-in's 2.5 + 5 ms: the three ratios follow from our medians printed beside them
    row = re.search(r'^\| resnet20-b1 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| '
                    r'([\d.]+) ms \| 7\.5 ms \| [\d.]+ to [\d.]+ \|$', out, re.M)
    assert row, out
    assert abs(float(row.group(5)) / 7.5 / float(row.group(3)) - 1) < 0.02, out
    assert re.search(r'^by layer type', out, re.M) and 'load average (1 minute)' in out, out


def test_cpu_suite_nets_build_and_retinaface_runs_small():
    """Every net of the suite builds as the timed net; the RetinaFace prototxt is what its
    generator writes and runs a forward and backward at 64 x 64 (strides 8 to 32: the
    Deconvolution's 2x upsampling meets the lateral's 4 x 4 and 8 x 8 exactly)."""
    sys.path.insert(0, str(ROOT / 'benchmarks'))
    import cpu_suite
    from caffe_syncbn import TRAIN, Net
    from caffe_syncbn.analysis.timing import timing_net_param
    for model, batch, _ in cpu_suite.NETS.values():
        require(pathlib.Path(model))
        timing_net_param(model, batch)
    nets = ROOT / 'benchmarks' / 'nets'
    written = watchdog.run([sys.executable, str(nets / 'make_retinaface.py')],
                           capture_output=True, text=True, check=True).stdout
    assert written == (nets / 'retinaface_mnet025_deploy.prototxt').read_text()
    param = timing_net_param(str(nets / 'retinaface_mnet025_deploy.prototxt'), 1)
    param.layer[0].input_param.shape[0].dim[2:] = [64, 64]
    net = Net(param, TRAIN)
    for layer in net.layers:           # global statistics of mean 0, variance 1
        if layer.type == 'BatchNorm':
            layer.blobs[1].data[...] = layer.blobs[2].data[...] = 1
    net.blobs['data'].data[...] = np.random.RandomState(0).randn(*net.blobs['data'].shape)
    net.forward_backward()
    assert net.blobs['face_rpn_landmark_pred_stride8'].shape == (1, 20, 8, 8)
    assert net.blobs['face_rpn_cls_prob_stride32'].shape == (1, 4, 2, 2)
    prob = net.blobs['face_rpn_cls_prob_stride32'].data.reshape(1, 2, 2, 2, 2)
    assert np.allclose(prob.sum(axis=1), 1, atol=1e-5)
    assert np.isfinite(net.blobs['data'].diff).all()


def test_resnet101_prototxt_is_its_generators_in_the_released_layout():
    """The committed ResNet-101 is what make_resnet101.py writes; the generator writes the
    released ResNet-50 (examples/) as it is, and ResNet-101 builds with the stages' shapes
    and torchvision's 44,549,160 learned values (convolutions, classifier, and the Scale
    layers' gamma and beta, which torchvision's BatchNorm holds)."""
    from caffe_syncbn import TEST, Net
    from caffe_syncbn.analysis.timing import timing_net_param
    nets = ROOT / 'benchmarks' / 'nets'

    def written(*args):
        return watchdog.run([sys.executable, str(nets / 'make_resnet101.py')] + list(args),
                            capture_output=True, text=True, check=True).stdout
    assert written() == (nets / 'resnet101_deploy.prototxt').read_text()
    released = ROOT / 'examples' / 'resnet50' / 'ResNet-50-deploy.prototxt'
    assert written('50') == released.read_text()
    stages = {'res2c': 256, 'res3b3': 512, 'res4b22': 1024, 'res5c': 2048}
    net = Net(timing_net_param(str(nets / 'resnet101_deploy.prototxt'), 2), TEST,
              memory_plan='share', keep=list(stages))
    for k, (name, channels) in enumerate(stages.items()):
        assert net.blobs[name].shape == (2, channels, 56 >> k, 56 >> k)
    assert net.blobs['prob'].shape == (2, 1000)
    assert sum(blob.data.size for layer in net.layers for blob in layer.blobs
               if layer.type in ('Convolution', 'InnerProduct', 'Scale')) == 44549160
    assert sum(layer.type == 'Convolution' for layer in net.layers) == 104
