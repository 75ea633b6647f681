#!/usr/bin/env python3
"""Writes ResNet-20 for CIFAR-10 as a deploy prototxt for the CPU benchmarks:

    python benchmarks/nets/make_resnet20.py > benchmarks/nets/resnet20_cifar_deploy.prototxt

The architecture is section 4.2 of He et al., "Deep Residual Learning for Image
Recognition" (2016): a 3x3 convolution of 16 channels, three stages of three basic blocks
(two 3x3 convolutions each) at 16, 32 and 64 channels, the first convolution of the second
and third stages at stride 2 with a 1x1 projection on the shortcut, global average pooling
and a 10-way classifier. Every convolution is followed by BatchNorm + Scale (+ ReLU), as
the Caffe ports of the net write it.
"""


def convolution(name, bottom, outputs, kernel, stride, relu=True):
    """A convolution with its BatchNorm, Scale (and ReLU), in place: prototxt lines."""
    lines = [
        'layer { name: "%s" type: "Convolution" bottom: "%s" top: "%s"' % (name, bottom, name),
        '  convolution_param { num_output: %d bias_term: false kernel_size: %d pad: %d '
        'stride: %d weight_filler { type: "msra" } } }' % (outputs, kernel, kernel // 2, stride),
        'layer { name: "%s/bn" type: "BatchNorm" bottom: "%s" top: "%s"' % (name, name, name),
        '  batch_norm_param { use_global_stats: true } }',
        'layer { name: "%s/scale" type: "Scale" bottom: "%s" top: "%s"' % (name, name, name),
        '  scale_param { bias_term: true } }']
    if relu:
        lines.append('layer { name: "%s/relu" type: "ReLU" bottom: "%s" top: "%s" }'
                     % (name, name, name))
    return lines


def main():
    lines = ['# ResNet-20 for CIFAR-10 (He et al. 2016, section 4.2); written by make_resnet20.py',
             'name: "ResNet-20"',
             'layer { name: "data" type: "Input" top: "data"',
             '  input_param { shape { dim: 1 dim: 3 dim: 32 dim: 32 } } }']
    lines += convolution('conv1', 'data', 16, 3, 1)
    bottom, channels = 'conv1', 16
    for stage, outputs in enumerate((16, 32, 64), 1):
        for block in range(3):
            name = 'res%d_%d' % (stage, block)
            stride = 2 if block == 0 and outputs != channels else 1
            lines += convolution(name + 'a', bottom, outputs, 3, stride)
            lines += convolution(name + 'b', name + 'a', outputs, 3, 1, relu=False)
            shortcut = bottom
            if outputs != channels:
                lines += convolution(name + 'p', bottom, outputs, 1, stride, relu=False)
                shortcut = name + 'p'
            lines += ['layer { name: "%s" type: "Eltwise" bottom: "%s" bottom: "%sb" top: "%s" }'
                      % (name, shortcut, name, name),
                      'layer { name: "%s/relu" type: "ReLU" bottom: "%s" top: "%s" }'
                      % (name, name, name)]
            bottom, channels = name, outputs
    lines += ['layer { name: "pool" type: "Pooling" bottom: "%s" top: "pool"' % bottom,
              '  pooling_param { pool: AVE global_pooling: true } }',
              'layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"',
              '  inner_product_param { num_output: 10 weight_filler { type: "msra" } } }',
              'layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }']
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
