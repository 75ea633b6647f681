"""The detection layers on the kernels of cuda/detection.cu (``LayerContext.cuda_kernels``, the
kernels emulated on the CPU by tests/helpers/cuda_emulation.py) against their array code: the small
MobileNet-SSD net of tests/ssd_golden gives the same detections (and the fork's), MultiBoxLoss
the same losses and gradients in every golden setting (matching on priors and on decoded
boxes, per class, cross-boundary priors ignored), DetectionEvaluate the same rows."""

import numpy as np
import pytest
from helpers.cuda_emulation import emulated_kernels
from google.protobuf import text_format

from caffe_syncbn import TEST, TRAIN, Blob, LayerContext, Net, caffe_pb2
from caffe_syncbn.layer import create_layer
from caffe_syncbn.layers.detection import boxes, gpu as detection_gpu
from helpers.paths import SSD_GOLDEN as GOLDEN

MULTIBOX_CASES = sorted(p.stem for p in GOLDEN.glob('multibox_loss_*.npz'))
TOL = {np.float64: 1e-10, np.float32: 1e-5}


def golden(name):
    net = text_format.Parse((GOLDEN / (name + '.prototxt')).read_text(), caffe_pb2.NetParameter())
    return net.layer[-1], np.load(GOLDEN / (name + '.npz'))


def layer_on(param, arrays, dtype, kernels):
    ctx = LayerContext(phase=TRAIN, dtype=dtype, rng=np.random.RandomState(0),
                       cuda_kernels=kernels)
    layer = create_layer(param, ctx)
    bottom = []
    for array in arrays:
        blob = Blob(np.shape(array), dtype)
        blob.data[...] = array
        bottom.append(blob)
    top = [Blob((), dtype) for _ in param.top]
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    return layer, bottom, top


@pytest.mark.parametrize('dtype', [np.float64, np.float32])
def test_mini_ssd_net_gives_the_same_detections(monkeypatch, dtype):
    emulated_kernels(monkeypatch)
    monkeypatch.chdir(GOLDEN)
    ref = np.load('mini_ssd.npz')
    out = {}
    for kernels in (False, True):
        net = Net('mini_ssd_deploy.prototxt', TEST, weights='mini_ssd.caffemodel',
                  context=LayerContext(phase=TEST, dtype=dtype, cuda_kernels=kernels))
        assert net.layer_dict['detection_out'].engine is (detection_gpu if kernels else boxes)
        net.forward(data=ref['data/data'])
        out[kernels] = net.blobs['detection_out'].data.copy()
    host, fast = out[False][0, 0], out[True][0, 0]
    assert len(host) > 4 and len(set(host[:, 1])) > 1
    assert host.shape == fast.shape
    np.testing.assert_array_equal(fast[:, :2], host[:, :2])
    np.testing.assert_allclose(fast[:, 2:], host[:, 2:], rtol=TOL[dtype], atol=TOL[dtype])
    theirs = ref['data/detection_out'][0, 0]
    np.testing.assert_array_equal(fast[:, :2], theirs[:, :2])
    np.testing.assert_allclose(fast[:, 2:], theirs[:, 2:], atol=1e-4)


@pytest.mark.parametrize('dtype', [np.float64, np.float32])
@pytest.mark.parametrize('name', MULTIBOX_CASES)
def test_multibox_loss_on_kernels_equals_array_code(monkeypatch, name, dtype):
    emulated_kernels(monkeypatch)
    param, ref = golden(name)
    results = []
    for kernels in (False, True):
        layer, bottom, top = layer_on(param, [ref['data/' + b] for b in
                                              ('loc', 'conf', 'priors', 'label')], dtype, kernels)
        assert layer.engine is (detection_gpu if kernels else boxes)
        layer.forward(bottom, top)
        top[0].diff[...] = ref['topdiff/loss']
        layer.backward(top, list(param.propagate_down), bottom)
        results.append([top[0].data.copy(), bottom[0].diff.copy(), bottom[1].diff.copy()])
    for host, fast, what in zip(*results, ('loss', 'loc diff', 'conf diff')):
        np.testing.assert_allclose(fast, host, rtol=TOL[dtype], atol=TOL[dtype], err_msg=what)
    np.testing.assert_allclose(float(results[1][0]), float(ref['data/loss']), rtol=2e-5)


@pytest.mark.parametrize('name', ['detection_evaluate_difficult_counted',
                                  'detection_evaluate_difficult_ignored'])
def test_detection_evaluate_on_kernels_equals_array_code(monkeypatch, name):
    emulated_kernels(monkeypatch)
    param, ref = golden(name)
    rows = []
    for kernels in (False, True):
        layer, bottom, top = layer_on(param, [ref['data/' + b] for b in param.bottom],
                                      np.float32, kernels)
        layer.forward(bottom, top)
        rows.append(top[0].data.copy())
    np.testing.assert_array_equal(rows[1], rows[0])
    np.testing.assert_allclose(rows[1], ref['data/' + param.top[0]], rtol=1e-5, atol=1e-6)
    assert (rows[1][0, 0, :, 3] == 1).any() and (rows[1][0, 0, :, 4] == 1).any()
