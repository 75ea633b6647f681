"""Caffemodels written by this project load in OpenCV's Caffe importer and give the same outputs.

OpenCV (opencv-python-headless<5) is an independent Caffe implementation: random weights are
saved with ``net.save``, read back by ``cv2.dnn.readNetFromCaffe`` and both nets run forward.
"""
import numpy as np
import pytest

import caffe_syncbn as caffe
from helpers.paths import CORPUS, require

cv2 = pytest.importorskip('cv2', reason='OpenCV is absent: pip install "opencv-python-headless<5"')

BN_SCALE = '''name: "bn_scale"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" batch_norm_param { eps: 0.001 } }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip" inner_product_param { num_output: 5 } }
'''
DECONV_CROP = '''name: "deconv_crop"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 11 dim: 11 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 stride: 2 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "up" type: "Deconvolution" bottom: "conv" top: "up"
        convolution_param { num_output: 2 kernel_size: 4 stride: 2 } }
layer { name: "crop" type: "Crop" bottom: "up" bottom: "data" top: "crop"
        crop_param { axis: 2 offset: 1 } }
'''


def randomize(net, rs):
    for layer in net.layers:
        for i, blob in enumerate(layer.blobs):
            if layer.type == 'BatchNorm':      # mean sum, variance sum, scale factor
                blob.data[...] = [rs.standard_normal(blob.shape), rs.uniform(0.5, 2, blob.shape),
                                  np.full(blob.shape, 2.5)][i]
            else:
                blob.data[...] = rs.standard_normal(blob.shape) / np.sqrt(max(1, np.prod(blob.shape[1:])))


def crosscheck(tmp_path, prototxt, input_shape, outputs):
    net = caffe.Net(str(prototxt), caffe.TEST)
    rs = np.random.RandomState(0)
    randomize(net, rs)
    weights = tmp_path / 'weights.caffemodel'
    net.save(str(weights))
    x = rs.uniform(-1, 1, input_shape).astype(np.float32)
    net.forward(data=x)
    reference = cv2.dnn.readNetFromCaffe(str(prototxt), str(weights))
    reference.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    reference.setInput(x)
    for name, theirs in zip(outputs, reference.forward(outputs)):
        ours = net.blobs[name].data
        assert theirs.shape == ours.shape, name
        scale = max(1.0, float(np.abs(theirs).max()))
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * scale, err_msg=name)


def write(tmp_path, text):
    path = tmp_path / 'net.prototxt'
    path.write_text(text)
    return path


def test_lenet(tmp_path):
    path = require(CORPUS / 'BVLC_caffe__examples_mnist_lenet.prototxt')
    crosscheck(tmp_path, path, (2, 1, 28, 28), ['ip2', 'prob'])


def test_cifar10_quick(tmp_path):
    path = require(CORPUS / 'BVLC_caffe__examples_cifar10_cifar10_quick.prototxt')
    crosscheck(tmp_path, path, (1, 3, 32, 32), ['ip2', 'prob'])


def test_batchnorm_scale(tmp_path):
    crosscheck(tmp_path, write(tmp_path, BN_SCALE), (2, 3, 8, 8), ['pool', 'ip'])


def test_deconvolution_crop(tmp_path):
    crosscheck(tmp_path, write(tmp_path, DECONV_CROP), (1, 3, 11, 11), ['up', 'crop'])
