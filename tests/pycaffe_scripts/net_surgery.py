"""Net surgery as in pycaffe's example: LeNet's fully connected layers become convolutions
(params copied with .flat), so the net classifies every 28x28 window of a larger image.

usage: net_surgery.py lenet.prototxt lenet.caffemodel WORK (WORK holds digit.npy, 40x44)
"""
import caffe_syncbn
caffe_syncbn.install_as_caffe()

import sys  # noqa: E402

import numpy as np  # noqa: E402

import caffe  # noqa: E402
from caffe import layers as L, params as P  # noqa: E402

lenet_def, lenet_weights, work = sys.argv[1:4]

# LeNet's fully convolutional twin: ip1 (500 x 800) becomes a 4x4 convolution, ip2 a 1x1
n = caffe.NetSpec()
n.data = L.Input(shape=dict(dim=[1, 1, 40, 44]))
n.conv1 = L.Convolution(n.data, num_output=20, kernel_size=5)
n.pool1 = L.Pooling(n.conv1, pool=P.Pooling.MAX, kernel_size=2, stride=2)
n.conv2 = L.Convolution(n.pool1, num_output=50, kernel_size=5)
n.pool2 = L.Pooling(n.conv2, pool=P.Pooling.MAX, kernel_size=2, stride=2)
n['ip1-conv'] = L.Convolution(n.pool2, num_output=500, kernel_size=4)
n.relu1 = L.ReLU(n['ip1-conv'], in_place=True)
n['ip2-conv'] = L.Convolution(n.relu1, num_output=10, kernel_size=1)
n.prob = L.Softmax(n['ip2-conv'])
with open(work + '/lenet_full_conv.prototxt', 'w') as f:
    f.write(str(n.to_proto()))

net = caffe.Net(lenet_def, lenet_weights, caffe.TEST)
params = ['ip1', 'ip2']
fc_params = {pr: (net.params[pr][0].data, net.params[pr][1].data) for pr in params}
for fc in params:
    print('{} weights are {} dimensional and biases are {} dimensional'.format(
        fc, fc_params[fc][0].shape, fc_params[fc][1].shape))

net_full_conv = caffe.Net(work + '/lenet_full_conv.prototxt', lenet_weights, caffe.TEST)
params_full_conv = ['ip1-conv', 'ip2-conv']
conv_params = {pr: (net_full_conv.params[pr][0].data, net_full_conv.params[pr][1].data)
               for pr in params_full_conv}
for pr, pr_conv in zip(params, params_full_conv):
    conv_params[pr_conv][0].flat = fc_params[pr][0].flat   # flat unrolls the arrays
    conv_params[pr_conv][1][...] = fc_params[pr][1]
net_full_conv.save(work + '/lenet_full_conv.caffemodel')

net_full_conv.blobs['data'].data[0, 0] = np.load(work + '/digit.npy')
out = net_full_conv.forward()
print(out['prob'][0].argmax(axis=0))
np.save(work + '/prob_map.npy', out['prob'][0])
