"""pycaffe scripts run unchanged but for the install line (tests/pycaffe_scripts/), each in a
fresh interpreter; what they write is checked against independent references: OpenCV's
image reading and resizing, our Net run on hand-cut crops, the corpus FCN-8s deploy file,
Caffe's own bilinear filler, and the built-in layers."""
import os
import sys

import numpy as np
import pytest
from helpers import watchdog
from google.protobuf import text_format

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2

from helpers.paths import CORPUS, GOLDEN, ROOT, require

cv2 = pytest.importorskip('cv2')
SCRIPTS = ROOT / 'tests' / 'pycaffe_scripts'
MEAN_BGR = np.array([104.0, 117.0, 123.0])


def run_script(name, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = watchdog.run([sys.executable, str(SCRIPTS / name)] + [str(a) for a in args],
                          capture_output=True, text=True, env=env, limit=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def smooth_image(rng, height, width, channels):
    """A uint8 image with structure at several scales (so resizing matters)."""
    small = rng.rand(max(2, height // 6), max(2, width // 6), channels).astype(np.float32)
    image = cv2.resize(small, (width, height), interpolation=cv2.INTER_CUBIC)
    image += 0.15 * rng.rand(height, width, channels).astype(np.float32)
    return np.clip(image.reshape(height, width, channels) * 230, 0, 255).astype(np.uint8)


def reference_input(bgr_uint8, size):
    """The classification example's preprocessing, done with OpenCV: BGR, [0, 255], mean off."""
    image = bgr_uint8.astype(np.float32) / 255
    if image.shape[:2] != (size, size):
        image = cv2.resize(image, (size, size), interpolation=cv2.INTER_LINEAR)
    return image.transpose(2, 0, 1) * 255 - MEAN_BGR[:, None, None]


def run_net(prototxt, weights, batch):
    net = caffe.Net(str(prototxt), caffe.TEST, weights=str(weights))
    return net.forward(data=np.asarray(batch, np.float32))['prob'].copy()


def test_classification_with_transformer_and_classifier(tmp_path):
    model, weights = require(GOLDEN / 'net_cifar10_quick.prototxt'), GOLDEN / 'net_cifar10_quick.caffemodel'
    rng = np.random.RandomState(3)
    images = [smooth_image(rng, h, w, 3) for h, w in ((32, 32), (48, 40), (20, 26))]
    for i, image in enumerate(images):
        cv2.imwrite(str(tmp_path / ('image%d.png' % i)), image)
    run_script('classify.py', model, weights, tmp_path)

    expected = np.array([reference_input(image, 32) for image in images])
    np.testing.assert_allclose(np.load(tmp_path / 'inputs.npy'), expected, rtol=0, atol=2e-3)
    np.testing.assert_allclose(np.load(tmp_path / 'probs.npy'), run_net(model, weights, expected),
                               rtol=1e-4, atol=1e-6)

    # Classifier: resize to 36x36, then the 10 crops (corners, centre, mirrored) or the centre
    resized = [cv2.resize(image.astype(np.float32) / 255, (36, 36), interpolation=cv2.INTER_LINEAR)
               for image in images]
    corners = [(0, 0), (0, 4), (4, 0), (4, 4), (2, 2)]
    crops = []
    for image in resized:
        five = [image[y:y + 32, x:x + 32] for y, x in corners]
        crops += five + [crop[:, ::-1] for crop in five]
    batch = [crop.transpose(2, 0, 1) * 255 - MEAN_BGR[:, None, None] for crop in crops]
    oversampled = run_net(model, weights, batch).reshape(3, 10, 10).mean(1)
    np.testing.assert_allclose(np.load(tmp_path / 'oversampled.npy'), oversampled, rtol=1e-4, atol=1e-6)
    center = run_net(model, weights, [batch[10 * i + 4] for i in range(3)])
    np.testing.assert_allclose(np.load(tmp_path / 'center.npy'), center, rtol=1e-4, atol=1e-6)
    assert not np.allclose(oversampled, center, atol=1e-4)     # the two paths do differ


def test_net_surgery_fc_to_conv(tmp_path):
    model, weights = require(GOLDEN / 'net_lenet.prototxt'), GOLDEN / 'net_lenet.caffemodel'
    digit = np.random.RandomState(5).rand(40, 44).astype(np.float32)
    np.save(tmp_path / 'digit.npy', digit)
    run_script('net_surgery.py', model, weights, tmp_path)

    prob_map = np.load(tmp_path / 'prob_map.npy')
    assert prob_map.shape == (10, 4, 5)
    windows = [digit[4 * i:4 * i + 28, 4 * j:4 * j + 28] for i in range(4) for j in range(5)]
    lenet = caffe.Net(str(model), caffe.TEST, weights=str(weights))
    probs = lenet.forward_all(data=np.array(windows)[:, None])['prob']   # LeNet's batch is 2
    np.testing.assert_allclose(prob_map.reshape(10, 20).T, probs, rtol=1e-4, atol=1e-6)

    saved = caffe.Net(str(tmp_path / 'lenet_full_conv.prototxt'), caffe.TEST,
                      weights=str(tmp_path / 'lenet_full_conv.caffemodel'))
    np.testing.assert_array_equal(saved.params['ip1-conv'][0].data.reshape(500, 800),
                                  lenet.params['ip1'][0].data)


def test_fcn_coord_map_and_bilinear_surgery(tmp_path):
    deploy = require(CORPUS / 'shelhamer_fcn.berkeleyvision.org__voc-fcn8s_deploy.prototxt')
    ys, xs = np.mgrid[:37, :41].astype(np.float32)
    image = 0.3 * ys - 0.2 * xs + 5
    np.save(tmp_path / 'image.npy', image)
    run_script('fcn_surgery.py', tmp_path)

    def crops(net):
        return {layer.name: (list(layer.bottom), layer.crop_param.axis, list(layer.crop_param.offset))
                for layer in net.layer if layer.type == 'Crop'}

    ours = text_format.Parse((tmp_path / 'fcn8s.prototxt').read_text(), caffe_pb2.NetParameter())
    published = text_format.Parse(deploy.read_text(), caffe_pb2.NetParameter())
    assert crops(ours) == crops(published)       # offsets 5, 9 and 31

    # the upsampling kernels are Caffe's bilinear filler (recorded from BVLC Caffe)
    from caffe_syncbn.formats.caffemodel import read_weights
    from caffe_syncbn.weights.copy import arrays_of
    recorded = read_weights(str(require(GOLDEN / 'deconv_bilinear_x2.caffemodel')))
    bilinear = arrays_of(recorded)['deconvolution'][0]
    np.testing.assert_allclose(np.load(tmp_path / 'upscore_weights.npy')[0, 0], bilinear[0, 0], atol=1e-7)
    # aligned by the crop: pooling then bilinear upsampling gives back a linear ramp exactly
    score = np.load(tmp_path / 'score.npy')
    assert score.shape == image.shape
    np.testing.assert_allclose(score[3:-3, 3:-3], image[3:-3, 3:-3], rtol=0, atol=1e-4)


def test_python_loss_layer_trains_as_the_builtin_layers(tmp_path):
    rng = np.random.RandomState(7)
    np.savez(tmp_path / 'data.npz', x=rng.randn(2, 8, 5), y=rng.randn(2, 8, 3),
             w0=rng.randn(3, 5) * 0.3)
    results = {}
    for variant in ('python', 'builtin'):
        run_script('python_loss.py', tmp_path, variant)
        results[variant] = np.load(tmp_path / ('%s.npz' % variant))
    python, builtin = results['python'], results['builtin']
    assert int(python['iter']) == 6
    assert python['losses'][-1] < python['losses'][0]
    for key in ('losses', 'w', 'b'):
        np.testing.assert_allclose(python[key], builtin[key], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(python['s'].ravel(), builtin['s'].ravel(), rtol=1e-5)
    assert abs(float(python['s'].ravel()[0]) - 1) > 1e-3        # the add_blob param did learn
