#!/usr/bin/env python3
"""Writes a RetinaFace-style face detector as a deploy prototxt for the CPU benchmarks:

    python benchmarks/nets/make_retinaface.py > benchmarks/nets/retinaface_mnet025_deploy.prototxt

The architecture is that of Deng et al., "RetinaFace: Single-stage Dense Face
Localisation in the Wild" (2019), in its small "mnet0.25" form as the public ports
write it (insightface's mxnet mnet.25, its Caffe conversions such as
Charrin/RetinaFace-Cpp, and biubug6/Pytorch_Retinaface's mobilenet0.25 config):

- body: MobileNet v1 at width 0.25 (make_mobilenet.py's blocks with a quarter of the
  channels), every convolution with BatchNorm + Scale + ReLU, the 3x3 ones depthwise;
  its outputs at strides 8, 16 and 32 (64, 128 and 256 channels) feed the pyramid;
- FPN: a 1x1 lateral convolution of 64 channels per level; the coarser level is
  upsampled 2x by a per-channel Deconvolution (fixed bilinear weights, as the Caffe ports
  replace mxnet's UpSampling), cropped to the lateral's size (Crop), added (Eltwise)
  and merged by a 3x3 convolution;
- SSH context module per level: a 3x3 branch of 32 channels, and 3x3 chains of 16
  channels standing for 5x5 and 7x7 receptive fields, concatenated to 64 and ReLU;
- heads per level, 2 anchors each: face/background scores (reshaped for a 2-way
  Softmax and back), 4 box offsets and 5 landmarks (10 values) per anchor.

The input is 640 x 640, as RetinaFace is commonly run for benchmarks.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from make_mobilenet import BLOCKS, convolution  # noqa: E402  (a sibling script)
from make_resnet20 import convolution as convolution_maybe_relu  # noqa: E402

WIDTH = 0.25
#: the MobileNet blocks that end each pyramid level (strides 8, 16, 32)
LEVEL_ENDS = (4, 10, 12)
FPN_CHANNELS = 64
ANCHORS = 2


def body():
    """MobileNet-0.25 up to stride 32: prototxt lines and the blob names of the levels."""
    lines = convolution('conv1', 'data', int(32 * WIDTH), 3, 2)
    bottom, channels, levels = 'conv1', int(32 * WIDTH), []
    for k, (outputs, stride) in enumerate(BLOCKS):
        outputs = int(outputs * WIDTH)
        lines += convolution('conv%d_dw' % (k + 2), bottom, channels, 3, stride, group=channels)
        lines += convolution('conv%d_sep' % (k + 2), 'conv%d_dw' % (k + 2), outputs, 1, 1)
        bottom, channels = 'conv%d_sep' % (k + 2), outputs
        if k in LEVEL_ENDS:
            levels.append(bottom)
    return lines, levels


def pyramid(levels):
    """The FPN's top-down pass: prototxt lines and the merged blob of each level."""
    lines = []
    for i, level in enumerate(levels):
        lines += convolution('fpn%d' % i, level, FPN_CHANNELS, 1, 1)
    merged = ['fpn%d' % (len(levels) - 1)]
    for i in reversed(range(len(levels) - 1)):
        coarser, up = merged[0], 'fpn%d_up' % i
        lines += [
            'layer { name: "%s" type: "Deconvolution" bottom: "%s" top: "%s"' % (up, coarser, up),
            '  param { lr_mult: 0 decay_mult: 0 }',
            '  convolution_param { num_output: %d group: %d kernel_size: 4 stride: 2 pad: 1 '
            'bias_term: false weight_filler { type: "bilinear" } } }'
            % (FPN_CHANNELS, FPN_CHANNELS),
            'layer { name: "%s_crop" type: "Crop" bottom: "%s" bottom: "fpn%d" top: "%s_crop"'
            % (up, up, i, up),
            '  crop_param { axis: 2 offset: 0 } }',
            'layer { name: "fpn%d_sum" type: "Eltwise" bottom: "fpn%d" bottom: "%s_crop" '
            'top: "fpn%d_sum" }' % (i, i, up, i)]
        lines += convolution('fpn%d_merge' % i, 'fpn%d_sum' % i, FPN_CHANNELS, 3, 1)
        merged.insert(0, 'fpn%d_merge' % i)
    return lines, merged


def context_module(name, bottom):
    """SSH: a 3x3 branch and two chains of 3x3s (5x5 and 7x7 fields), concatenated."""
    half, quarter = FPN_CHANNELS // 2, FPN_CHANNELS // 4
    lines = convolution_maybe_relu(name + '_c3', bottom, half, 3, 1, relu=False)
    lines += convolution(name + '_reduce', bottom, quarter, 3, 1)
    lines += convolution_maybe_relu(name + '_c5', name + '_reduce', quarter, 3, 1, relu=False)
    lines += convolution(name + '_c7a', name + '_reduce', quarter, 3, 1)
    lines += convolution_maybe_relu(name + '_c7', name + '_c7a', quarter, 3, 1, relu=False)
    lines += ['layer { name: "%s" type: "Concat" bottom: "%s_c3" bottom: "%s_c5" '
              'bottom: "%s_c7" top: "%s" }' % (name, name, name, name, name),
              'layer { name: "%s/relu" type: "ReLU" bottom: "%s" top: "%s" }' % (name, name, name)]
    return lines


def head(name, bottom, outputs):
    return ['layer { name: "%s" type: "Convolution" bottom: "%s" top: "%s"' % (name, bottom, name),
            '  convolution_param { num_output: %d kernel_size: 1 weight_filler { type: "msra" } '
            '} }' % outputs]


def heads(level, bottom):
    """Scores (a 2-way softmax per anchor), box offsets and landmarks of one level."""
    score = 'face_rpn_cls_score_stride%d' % level
    lines = head(score, bottom, 2 * ANCHORS)
    lines += ['layer { name: "%s_reshape" type: "Reshape" bottom: "%s" top: "%s_reshape"'
              % (score, score, score),
              '  reshape_param { shape { dim: 0 dim: 2 dim: -1 dim: 0 } } }',
              'layer { name: "%s_softmax" type: "Softmax" bottom: "%s_reshape" '
              'top: "%s_softmax" }' % (score, score, score),
              'layer { name: "face_rpn_cls_prob_stride%d" type: "Reshape" bottom: "%s_softmax" '
              'top: "face_rpn_cls_prob_stride%d"' % (level, score, level),
              '  reshape_param { shape { dim: 0 dim: %d dim: -1 dim: 0 } } }' % (2 * ANCHORS)]
    lines += head('face_rpn_bbox_pred_stride%d' % level, bottom, 4 * ANCHORS)
    lines += head('face_rpn_landmark_pred_stride%d' % level, bottom, 10 * ANCHORS)
    return lines


def main():
    lines = ['# RetinaFace, MobileNet-0.25 body (Deng et al. 2019; the public mnet0.25 ports); '
             'written by make_retinaface.py',
             'name: "RetinaFace-mnet0.25"',
             'layer { name: "data" type: "Input" top: "data"',
             '  input_param { shape { dim: 1 dim: 3 dim: 640 dim: 640 } } }']
    body_lines, levels = body()
    fpn_lines, merged = pyramid(levels)
    lines += body_lines + fpn_lines
    for stride, bottom in zip((8, 16, 32), merged):
        lines += context_module('ssh_stride%d' % stride, bottom)
        lines += heads(stride, 'ssh_stride%d' % stride)
    print('\n'.join(lines))


if __name__ == '__main__':
    main()
