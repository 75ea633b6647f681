#!/usr/bin/env python3
"""Writes MobileNet v1 as a deploy prototxt for the CPU benchmarks:

    python benchmarks/nets/make_mobilenet.py > benchmarks/nets/mobilenet_v1_deploy.prototxt

The architecture is Table 1 of Howard et al., "MobileNets: Efficient Convolutional Neural
Networks for Mobile Vision Applications" (2017): a 3x3 convolution, then 13 blocks of a
3x3 depthwise and a 1x1 pointwise convolution, global average pooling and a 1x1
classifier. Every convolution is followed by BatchNorm + Scale + ReLU, as the Caffe ports
of the net write it.
"""

#: (output channels, stride) of each depthwise-separable block
BLOCKS = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)] + [(512, 1)] * 5 + \
    [(1024, 2), (1024, 1)]


def convolution(name, bottom, outputs, kernel, stride, group=1):
    """A convolution with its BatchNorm, Scale and ReLU, in place: prototxt lines."""
    grouped = ' group: %d engine: CAFFE' % group if group > 1 else ''
    return [
        'layer { name: "%s" type: "Convolution" bottom: "%s" top: "%s"' % (name, bottom, name),
        '  convolution_param { num_output: %d bias_term: false kernel_size: %d pad: %d '
        'stride: %d%s weight_filler { type: "msra" } } }'
        % (outputs, kernel, kernel // 2, stride, grouped),
        'layer { name: "%s/bn" type: "BatchNorm" bottom: "%s" top: "%s"' % (name, name, name),
        '  batch_norm_param { use_global_stats: true } }',
        'layer { name: "%s/scale" type: "Scale" bottom: "%s" top: "%s"' % (name, name, name),
        '  scale_param { bias_term: true } }',
        'layer { name: "%s/relu" type: "ReLU" bottom: "%s" top: "%s" }' % (name, name, name)]


def main():
    lines = ['# MobileNet v1 (Howard et al. 2017, Table 1); written by make_mobilenet.py',
             'name: "MobileNet-v1"',
             'layer { name: "data" type: "Input" top: "data"',
             '  input_param { shape { dim: 1 dim: 3 dim: 224 dim: 224 } } }']
    lines += convolution('conv1', 'data', 32, 3, 2)
    bottom, channels = 'conv1', 32
    for k, (outputs, stride) in enumerate(BLOCKS, 2):
        lines += convolution('conv%d_dw' % k, bottom, channels, 3, stride, group=channels)
        lines += convolution('conv%d_sep' % k, 'conv%d_dw' % k, outputs, 1, 1)
        bottom, channels = 'conv%d_sep' % k, outputs
    lines += ['layer { name: "pool6" type: "Pooling" bottom: "%s" top: "pool6"' % bottom,
              '  pooling_param { pool: AVE global_pooling: true } }',
              'layer { name: "fc7" type: "Convolution" bottom: "pool6" top: "fc7"',
              '  convolution_param { num_output: 1000 kernel_size: 1 '
              'weight_filler { type: "msra" } } }',
              'layer { name: "prob" type: "Softmax" bottom: "fc7" top: "prob" }']
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
