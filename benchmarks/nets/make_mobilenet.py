#!/usr/bin/env python3
"""Writes mobilenet_v1_deploy.prototxt: MobileNet v1 as a deploy net for the CPU benchmarks
(python benchmarks/nets/make_mobilenet.py > benchmarks/nets/mobilenet_v1_deploy.prototxt)."""

lines = ['name: "MobileNet-v1"', 'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 224 dim: 224 } } }']
def conv(name, bottom, out, k, s, group=1):
    pad = k // 2
    g = ' group: %d engine: CAFFE' % group if group > 1 else ''
    lines.append('layer { name: "%s" type: "Convolution" bottom: "%s" top: "%s" convolution_param { num_output: %d bias_term: false kernel_size: %d pad: %d stride: %d%s weight_filler { type: "msra" } } }' % (name, bottom, name, out, k, pad, s, g))
    lines.append('layer { name: "%s/bn" type: "BatchNorm" bottom: "%s" top: "%s" batch_norm_param { use_global_stats: true } }' % (name, name, name))
    lines.append('layer { name: "%s/scale" type: "Scale" bottom: "%s" top: "%s" scale_param { bias_term: true } }' % (name, name, name))
    lines.append('layer { name: "%s/relu" type: "ReLU" bottom: "%s" top: "%s" }' % (name, name, name))
    return name
x = conv('conv1', 'data', 32, 3, 2)
channels = 32
for i, (out, s) in enumerate([(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)] + [(512, 1)] * 5 + [(1024, 2), (1024, 1)]):
    x = conv('conv%d_dw' % (i + 2), x, channels, 3, s, group=channels)
    x = conv('conv%d_sep' % (i + 2), x, out, 1, 1)
    channels = out
lines.append('layer { name: "pool6" type: "Pooling" bottom: "%s" top: "pool6" pooling_param { pool: AVE global_pooling: true } }' % x)
lines.append('layer { name: "fc7" type: "Convolution" bottom: "pool6" top: "fc7" convolution_param { num_output: 1000 kernel_size: 1 weight_filler { type: "msra" } } }')
lines.append('layer { name: "prob" type: "Softmax" bottom: "fc7" top: "prob" }')
print('# MobileNet v1 (Howard et al., "MobileNets: Efficient Convolutional Neural Networks for Mobile')
print('# Vision Applications", 2017, Table 1): 3x3 depthwise + 1x1 pointwise blocks, each conv')
print('# followed by BatchNorm + Scale + ReLU. Made by benchmarks/nets/make_mobilenet.py.')
print('\n'.join(lines))
