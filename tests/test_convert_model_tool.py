"""tools/convert_model.py as a user runs it: each subcommand writes files that we, OpenCV and
onnxruntime run with the outputs BVLC Caffe recorded for the original model."""
import sys

import numpy as np
import pytest
from helpers import watchdog

import caffe_syncbn as caffe
from caffe_syncbn.formats.caffemodel import read_net_param

from helpers.paths import GOLDEN, ROOT, require

TOOL = ROOT / 'tools' / 'convert_model.py'
CASE = 'format_hdf5_caffemodel'      # conv, BatchNorm (factor 2), Scale, ReLU, pool, IP, softmax


def convert(*args):
    return watchdog.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True,
                        text=True, limit=120, cwd=ROOT)


@pytest.fixture(scope='module')
def golden():
    prototxt = require(GOLDEN / (CASE + '.prototxt'))
    reference = np.load(GOLDEN / (CASE + '.npz'))
    return prototxt, reference['input/data'], reference['data/prob']


@pytest.mark.parametrize('command,weights_suffix,types', [
    ('to-syncbn', '.caffemodel', {'SyncBN'}),
    ('to-batchnorm', '.caffemodel.h5', {'BatchNorm', 'Scale'}),
    ('fold-bn', '.caffemodel', set()),
    ('to-deploy', '.caffemodel.h5', {'BatchNorm', 'Scale'}),
])
def test_caffe_outputs_run_with_caffes_recorded_outputs(tmp_path, golden, command,
                                                        weights_suffix, types):
    prototxt, x, prob = golden
    out = convert(command, '--model', prototxt, '--weights', GOLDEN / (CASE + weights_suffix),
                  '--output', tmp_path / 'out')
    assert out.returncode == 0, out.stderr
    assert 'wrote %s' % (tmp_path / 'out.prototxt') in out.stderr
    model, weights = str(tmp_path / 'out.prototxt'), str(tmp_path / 'out.caffemodel')
    stored = {layer.type for layer in read_net_param(weights).layer}
    assert stored & {'BatchNorm', 'Scale', 'BN', 'SyncBN'} == types
    ours = caffe.Net(model, caffe.TEST, weights=weights).forward(data=x)['prob']
    np.testing.assert_allclose(ours, prob, rtol=1e-4, atol=1e-6)
    if 'SyncBN' not in types:
        cv2 = pytest.importorskip('cv2')
        net = cv2.dnn.readNetFromCaffe(model, weights)
        net.setInput(x)
        np.testing.assert_allclose(net.forward('prob'), prob, rtol=1e-4, atol=1e-6)


def test_to_onnx_with_a_dynamic_batch(tmp_path, golden):
    ort = pytest.importorskip('onnxruntime')
    prototxt, x, prob = golden
    out = convert('to-onnx', '--model', prototxt, '--weights', GOLDEN / (CASE + '.caffemodel'),
                  '--output', tmp_path / 'net.onnx', '--dynamic-batch', '--opset', 18)
    assert out.returncode == 0, out.stderr
    session = ort.InferenceSession(str(tmp_path / 'net.onnx'), providers=['CPUExecutionProvider'])
    three = np.concatenate([x, x[:1]])
    got = session.run(['prob'], {'data': three})[0]
    np.testing.assert_allclose(got[:2], prob, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got[2], prob[0], rtol=1e-4, atol=1e-6)


def test_hdf5_output_and_input_shape(tmp_path, golden):
    prototxt, _, _ = golden
    out = convert('to-deploy', '--model', prototxt, '--weights', GOLDEN / (CASE + '.caffemodel'),
                  '--output', tmp_path / 'd', '--hdf5', '--input-shape', '5,3,8,8')
    assert out.returncode == 0, out.stderr
    net = caffe.Net(str(tmp_path / 'd.prototxt'), caffe.TEST,
                    weights=str(tmp_path / 'd.caffemodel.h5'))
    assert net.blobs['data'].shape == (5, 3, 8, 8)


@pytest.mark.parametrize('args,message', [
    (['fold-bn', '--model', '{proto}', '--output', '{out}'], 'fold-bn needs --weights'),
    (['to-syncbn', '--model', '{tmp}/nothere.prototxt', '--output', '{out}'],
     'nothere.prototxt: no such file'),
    (['to-onnx', '--model', '{proto}', '--output', '{out}', '--opset', '9'], 'opset 9'),
    (['to-deploy', '--model', '{proto}', '--output', '{tmp}/no/such/dir/x'], 'no/such/dir'),
    (['to-deploy', '--model', '{proto}', '--output', '{out}', '--input-shape', '1,x'],
     'expected positive sizes'),
])
def test_bad_input_is_one_line(tmp_path, golden, args, message):
    prototxt = golden[0]
    args = [a.format(proto=prototxt, out=tmp_path / 'out', tmp=tmp_path) for a in args]
    out = convert(*args)
    assert out.returncode != 0 and message in out.stderr
    assert 'Traceback' not in out.stderr and len(out.stderr.strip().splitlines()) <= 5
