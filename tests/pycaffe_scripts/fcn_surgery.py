"""FCN's habits: nets written with NetSpec whose Crop layers coord_map computes, and
deconvolutions initialized to bilinear upsampling by hand ("surgery").

usage: fcn_surgery.py WORK (WORK holds image.npy, 37x41)
Writes fcn8s.prototxt (VGG-16 FCN-8s, as FCN's net.py builds it), small.prototxt and
score.npy (the small net's output for the image).
"""
import caffe_syncbn
caffe_syncbn.install_as_caffe()

import sys  # noqa: E402

import numpy as np  # noqa: E402

import caffe  # noqa: E402
from caffe import layers as L, params as P  # noqa: E402
from caffe.coord_map import crop  # noqa: E402

work = sys.argv[1]


def conv_relu(bottom, nout, ks=3, stride=1, pad=1):
    conv = L.Convolution(bottom, kernel_size=ks, stride=stride, num_output=nout, pad=pad,
                         param=[dict(lr_mult=1, decay_mult=1), dict(lr_mult=2, decay_mult=0)])
    return conv, L.ReLU(conv, in_place=True)


def max_pool(bottom, ks=2, stride=2):
    return L.Pooling(bottom, pool=P.Pooling.MAX, kernel_size=ks, stride=stride)


def score(bottom, nout=21):
    return L.Convolution(bottom, num_output=nout, kernel_size=1, pad=0,
                         param=[dict(lr_mult=1, decay_mult=1), dict(lr_mult=2, decay_mult=0)])


def upscore(bottom, ks, stride, nout=21):
    return L.Deconvolution(bottom, param=[dict(lr_mult=0)], convolution_param=dict(
        num_output=nout, kernel_size=ks, stride=stride, bias_term=False))


def fcn8s():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 3, 500, 500]))
    n.conv1_1, n.relu1_1 = conv_relu(n.data, 64, pad=100)
    n.conv1_2, n.relu1_2 = conv_relu(n.relu1_1, 64)
    n.pool1 = max_pool(n.relu1_2)
    n.conv2_1, n.relu2_1 = conv_relu(n.pool1, 128)
    n.conv2_2, n.relu2_2 = conv_relu(n.relu2_1, 128)
    n.pool2 = max_pool(n.relu2_2)
    n.conv3_1, n.relu3_1 = conv_relu(n.pool2, 256)
    n.conv3_2, n.relu3_2 = conv_relu(n.relu3_1, 256)
    n.conv3_3, n.relu3_3 = conv_relu(n.relu3_2, 256)
    n.pool3 = max_pool(n.relu3_3)
    n.conv4_1, n.relu4_1 = conv_relu(n.pool3, 512)
    n.conv4_2, n.relu4_2 = conv_relu(n.relu4_1, 512)
    n.conv4_3, n.relu4_3 = conv_relu(n.relu4_2, 512)
    n.pool4 = max_pool(n.relu4_3)
    n.conv5_1, n.relu5_1 = conv_relu(n.pool4, 512)
    n.conv5_2, n.relu5_2 = conv_relu(n.relu5_1, 512)
    n.conv5_3, n.relu5_3 = conv_relu(n.relu5_2, 512)
    n.pool5 = max_pool(n.relu5_3)
    n.fc6, n.relu6 = conv_relu(n.pool5, 4096, ks=7, pad=0)
    n.drop6 = L.Dropout(n.relu6, dropout_ratio=0.5, in_place=True)
    n.fc7, n.relu7 = conv_relu(n.drop6, 4096, ks=1, pad=0)
    n.drop7 = L.Dropout(n.relu7, dropout_ratio=0.5, in_place=True)
    n.score_fr = score(n.drop7)
    n.upscore2 = upscore(n.score_fr, 4, 2)
    n.score_pool4 = score(n.pool4)
    n.score_pool4c = crop(n.score_pool4, n.upscore2)
    n.fuse_pool4 = L.Eltwise(n.upscore2, n.score_pool4c, operation=P.Eltwise.SUM)
    n.upscore_pool4 = upscore(n.fuse_pool4, 4, 2)
    n.score_pool3 = score(n.pool3)
    n.score_pool3c = crop(n.score_pool3, n.upscore_pool4)
    n.fuse_pool3 = L.Eltwise(n.upscore_pool4, n.score_pool3c, operation=P.Eltwise.SUM)
    n.upscore8 = upscore(n.fuse_pool3, 16, 8)
    n.score = crop(n.upscore8, n.data)
    return n.to_proto()


def small():
    """One padded convolution, a 2x pooling and a 2x upsampling, cropped back onto the input."""
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 37, 41]))
    n.conv = L.Convolution(n.data, num_output=1, kernel_size=3, pad=20, bias_term=False)
    n.pool = L.Pooling(n.conv, pool=P.Pooling.AVE, kernel_size=2, stride=2)
    n.upscore = upscore(n.pool, 4, 2, nout=1)
    n.score = crop(n.upscore, n.data)
    return n.to_proto()


def upsample_filt(size):
    """A size x size bilinear upsampling kernel."""
    factor = (size + 1) // 2
    center = factor - 1 if size % 2 == 1 else factor - 0.5
    og = np.ogrid[:size, :size]
    return (1 - abs(og[0] - center) / factor) * (1 - abs(og[1] - center) / factor)


def interp(net, layers):
    """Set the weights of deconvolution layers to bilinear upsampling."""
    for name in layers:
        m, k, h, w = net.params[name][0].data.shape
        if m != k and k != 1:
            raise ValueError('input + output channels need to be the same or |output| == 1')
        if h != w:
            raise ValueError('filters need to be square')
        net.params[name][0].data[range(m), range(k), :, :] = upsample_filt(h)


with open(work + '/fcn8s.prototxt', 'w') as f:
    f.write(str(fcn8s()))
with open(work + '/small.prototxt', 'w') as f:
    f.write(str(small()))

net = caffe.Net(work + '/small.prototxt', caffe.TEST)
net.params['conv'][0].data[...] = 0
net.params['conv'][0].data[0, 0, 1, 1] = 1              # the identity, shifted by the padding
interp(net, [k for k in net.params.keys() if 'up' in k])
net.blobs['data'].data[0, 0] = np.load(work + '/image.npy')
net.forward()
np.save(work + '/score.npy', net.blobs['score'].data[0, 0])
np.save(work + '/upscore_weights.npy', net.params['upscore'][0].data)
