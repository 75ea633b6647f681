#!/usr/bin/env python3
"""Writes ResNet-101 (or, given 50, ResNet-50) as a deploy prototxt for the benchmarks:

    python benchmarks/nets/make_resnet101.py > benchmarks/nets/resnet101_deploy.prototxt

The architecture is Table 1 of He et al., "Deep Residual Learning for Image Recognition"
(2016): a 7x7 convolution of stride 2 and a 3x3 max pooling, four stages of bottleneck
blocks (1x1, 3x3, 1x1 convolutions; 3, 4, 23 and 3 of them for ResNet-101, 3, 4, 6 and 3
for ResNet-50) at 64, 128, 256 and 512 channels (times 4 out of each block), a 7x7
average pooling and a 1000-way classifier. The layout is that of the Caffe models the
authors released (github.com/KaimingHe/deep-residual-networks): every convolution
followed by BatchNorm (use_global_stats) and Scale (bias_term), the stride of a stage's
first block on its first 1x1 convolution and on its projection shortcut (branch1), and
their names (res4b22_branch2a, bn4b22_branch2a, scale4b22_branch2a), and conv1 without a
bias in ResNet-101, with one in ResNet-50. Given 50, it writes
examples/resnet50/ResNet-50-deploy.prototxt as it is.
"""
import sys

#: blocks per stage; whether the blocks after a stage's first are numbered (res4b1,
#: res4b2, ...) rather than lettered (res4b, res4c, ...); whether conv1 has a bias: as
#: the released models have them
DEPTHS = {50: ((3, 4, 6, 3), (False, False, False, False), True),
          101: ((3, 4, 23, 3), (False, True, True, False), False)}


def layer(bottoms, top, name, kind, param=None, fields=()):
    """One layer in the released models' layout: tab-indented, a blank line after."""
    lines = ['layer {'] + ['\tbottom: "%s"' % b for b in bottoms]
    lines += ['\ttop: "%s"' % top, '\tname: "%s"' % name, '\ttype: "%s"' % kind]
    if param:
        lines += ['\t%s {' % param] + ['\t\t%s: %s' % field for field in fields] + ['\t}']
    return lines + ['}', '']


def convolution(bottom, top, outputs, kernel, stride, bn_name, scale_name, bias=False):
    """A convolution with its BatchNorm and Scale, in place."""
    fields = [('num_output', outputs), ('kernel_size', kernel), ('pad', kernel // 2),
              ('stride', stride)] + ([] if bias else [('bias_term', 'false')])
    return (layer([bottom], top, top, 'Convolution', 'convolution_param', fields)
            + layer([top], top, bn_name, 'BatchNorm', 'batch_norm_param',
                    [('use_global_stats', 'true')])
            + layer([top], top, scale_name, 'Scale', 'scale_param', [('bias_term', 'true')]))


def relu(blob, name):
    return layer([blob], blob, name, 'ReLU')


def block(bottom, stage, suffix, width, stride, projection):
    """One bottleneck block named res<stage><suffix>: prototxt lines."""
    name = '%d%s' % (stage, suffix)
    lines, shortcut = [], bottom
    if projection:
        shortcut = 'res%s_branch1' % name
        lines += convolution(bottom, shortcut, 4 * width, 1, stride, 'bn%s_branch1' % name,
                             'scale%s_branch1' % name)
    previous = bottom
    for branch, outputs, kernel, step in (('2a', width, 1, stride), ('2b', width, 3, 1),
                                          ('2c', 4 * width, 1, 1)):
        top = 'res%s_branch%s' % (name, branch)
        lines += convolution(previous, top, outputs, kernel, step,
                             'bn%s_branch%s' % (name, branch), 'scale%s_branch%s' % (name, branch))
        if branch != '2c':
            lines += relu(top, top + '_relu')
        previous = top
    lines += layer([shortcut, previous], 'res' + name, 'res' + name, 'Eltwise')
    return lines + relu('res' + name, 'res%s_relu' % name)


def resnet(depth):
    """The deploy prototxt of ResNet-``depth`` (a key of DEPTHS)."""
    counts, numbered, conv1_bias = DEPTHS[depth]
    lines = ['name: "ResNet-%d"' % depth, 'input: "data"', 'input_dim: 1', 'input_dim: 3',
             'input_dim: 224', 'input_dim: 224', '']
    lines += convolution('data', 'conv1', 64, 7, 2, 'bn_conv1', 'scale_conv1',
                         bias=conv1_bias)
    lines += relu('conv1', 'conv1_relu')
    lines += layer(['conv1'], 'pool1', 'pool1', 'Pooling', 'pooling_param',
                   [('kernel_size', 3), ('stride', 2), ('pool', 'MAX')])
    bottom = 'pool1'
    for stage, (count, by_number) in enumerate(zip(counts, numbered), 2):
        for k in range(count):
            suffix = 'a' if k == 0 else 'b%d' % k if by_number else chr(ord('a') + k)
            lines += block(bottom, stage, suffix, 64 << (stage - 2),
                           2 if k == 0 and stage > 2 else 1, projection=k == 0)
            bottom = 'res%d%s' % (stage, suffix)
    lines += layer([bottom], 'pool5', 'pool5', 'Pooling', 'pooling_param',
                   [('kernel_size', 7), ('stride', 1), ('pool', 'AVE')])
    lines += layer(['pool5'], 'fc1000', 'fc1000', 'InnerProduct', 'inner_product_param',
                   [('num_output', 1000)])
    lines += layer(['fc1000'], 'prob', 'prob', 'Softmax')
    return '\n'.join(lines) + '\n'


def main(argv):
    depth = int(argv[0]) if argv else 101
    if depth not in DEPTHS:
        sys.exit('make_resnet101.py: depth %d: give one of %s' % (depth, sorted(DEPTHS)))
    sys.stdout.write(resnet(depth))


if __name__ == '__main__':
    main(sys.argv[1:])
