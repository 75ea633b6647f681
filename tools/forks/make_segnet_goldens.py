"""Write tests/fork_golden/segnet/: SegNet's layers as SegNet's own Caffe runs them.

Run with the fork's pycaffe (tools/forks/build_segnet_caffe.sh builds it):

    PYTHONPATH=$HOME/caffe-ref/segnet-caffe/python python3 tools/forks/make_segnet_goldens.py

Each case is a small net (inputs declared with ``input``/``input_shape``, which the fork's
2015 Caffe reads and has no Input layer for) with fixed weights and inputs from numpy seeds.
The script writes <case>.prototxt, <case>.npz and, for nets with weights, the fork's own
<case>.caffemodel; the npz keys are those of ../shared/golden (its README): input/, data/,
topdiff/, diff/, param/ (the weights set), param_diff/, phase, and fork_commit. Param diffs
are zeroed before the backward. Naming cases rewrites only those.
"""
import pathlib
import sys
import zlib

from fork_goldens import caffe, inputs_text, run_data_case, run_net_case, write_pairs
import numpy as np

OUT = pathlib.Path(__file__).resolve().parents[2] / 'tests' / 'fork_golden' / 'segnet'

BN_FILLERS = 'scale_filler { type: "constant" value: 1 } shift_filler { type: "constant" value: 0 }'


def bn_net(mode, tops):
    return ('name: "bn_%s"\nforce_backward: true\n' % mode.lower()
            + inputs_text({'x': (2, 3, 5, 7)})
            + 'layer { name: "bn" type: "BN" bottom: "x" %s\n  bn_param { bn_mode: %s %s } }\n'
            % (' '.join('top: "%s"' % t for t in tops), mode, BN_FILLERS))


def channel_offsets(rs, shape):
    """Standard normal values about a mean of a few units per channel, as activations are."""
    return (rs.standard_normal(shape) * rs.uniform(0.5, 2, (1, shape[1], 1, 1))
            + rs.uniform(-3, 3, (1, shape[1], 1, 1))).astype(np.float32)


def upsample_net(upsample):
    return ('name: "unpool"\nforce_backward: true\n' + inputs_text({'x': (2, 3, 7, 9)})
            + 'layer { name: "pool" type: "Pooling" bottom: "x" top: "pooled" top: "mask"\n'
              '  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }\n'
              'layer { name: "unpool" type: "Upsample" bottom: "pooled" bottom: "mask" top: "y"\n'
              '  upsample_param { %s } }\n' % upsample)


def loss_net(loss_param):
    return ('name: "weighted_loss"\nforce_backward: true\n'
            + inputs_text({'score': (2, 4, 3, 5), 'label': (2, 1, 3, 5)})
            + 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" '
              'top: "loss"\n  loss_param { %s } }\n' % loss_param)


def bn_input(rs):
    return {'x': channel_offsets(rs, (2, 3, 5, 7))}


def unpool_input(rs):
    return {'x': rs.standard_normal((2, 3, 7, 9)).astype(np.float32)}


def scores_and_labels(ignore=None):
    """Scores of 4 classes and labels 0..3, four of them ``ignore`` when given."""
    def make(rs):
        score = rs.standard_normal((2, 4, 3, 5)).astype(np.float32) * 2
        label = rs.randint(0, 4, (2, 1, 3, 5)).astype(np.float32)
        if ignore is not None:
            label.flat[[1, 7, 20, 29]] = ignore
        return {'score': score, 'label': label}
    return make


CLASS_WEIGHTS = 'weight_by_label_freqs: true class_weighting: 0.2 class_weighting: 1.5 ' \
                'class_weighting: 0.7 class_weighting: 3.0'


def net_cases():
    """name -> (prototxt, phase, inputs of a RandomState, whether it has weights)."""
    return {
        'bn_learn': (bn_net('LEARN', ['y']), 'TRAIN', bn_input, True),
        'bn_learn_statistics': (bn_net('LEARN', ['y', 'mean', 'var']), 'TEST', bn_input, True),
        'bn_inference': (bn_net('INFERENCE', ['y']), 'TEST', bn_input, True),
        'upsample_mask_size': (upsample_net('upsample_h: 7 upsample_w: 9'), 'TRAIN',
                               unpool_input, False),
        'upsample_mask_scale_pad_out': (upsample_net('scale: 2 pad_out_h: true pad_out_w: true'),
                                        'TRAIN', unpool_input, False),
        'softmax_loss_class_weighting': (loss_net(CLASS_WEIGHTS), 'TRAIN', scores_and_labels(),
                                         False),
        'softmax_loss_class_weighting_ignore': (
            loss_net(CLASS_WEIGHTS + ' ignore_label: 255'), 'TRAIN', scores_and_labels(255),
            False),
        'softmax_loss_class_weighting_unnormalized': (
            loss_net(CLASS_WEIGHTS + ' ignore_label: 255 normalize: false'), 'TRAIN',
            scores_and_labels(255), False),
    }


def bn_params(rs, index, shape):
    """Scale about 1 with both signs present, shift about 0."""
    if index == 0:
        return rs.uniform(0.5, 1.5, shape) * rs.choice([-1, 1], shape)
    return rs.standard_normal(shape)


def dense_net(param, transform):
    return ('name: "dense"\nlayer { name: "data" type: "DenseImageData" top: "data" top: "label"\n'
            '  dense_image_data_param { source: "dense/pairs.txt" root_folder: "dense/"'
            ' batch_size: 2'
            ' %s }\n  transform_param { %s } }\n' % (param, transform))


DENSE_CASES = {
    'dense_image_data': dense_net('', 'mean_value: 104 mean_value: 117 mean_value: 123 scale: 0.5'),
    'dense_image_data_resized': dense_net('new_height: 5 new_width: 6', ''),
}


def main(wanted):
    OUT.mkdir(parents=True, exist_ok=True)
    caffe.set_mode_cpu()
    for name, case in net_cases().items():
        if not wanted or name in wanted:
            text, phase, make_inputs, has_params = case
            run_net_case(OUT, name, text, phase, [make_inputs], zlib.crc32(name.encode()),
                         bn_params if has_params else None)
            print('wrote', name)
    if not wanted or set(wanted) & set(DENSE_CASES):
        write_pairs(OUT / 'dense', np.random.RandomState(100))
        for name, text in DENSE_CASES.items():
            if not wanted or name in wanted:
                run_data_case(OUT, name, text, ('data', 'label'))
                print('wrote', name)


if __name__ == '__main__':
    main(sys.argv[1:])
