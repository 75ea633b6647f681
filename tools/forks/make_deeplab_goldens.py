"""Write tests/fork_golden/deeplab/: DeepLab v2's Interp, SegAccuracy, ImageSegData, MatWrite
and MatRead as DeepLab's own Caffe runs them.

Run with the fork's pycaffe (tools/forks/build_deeplab_caffe.sh builds it):

    PYTHONPATH=$HOME/caffe-ref/deeplab-caffe/python python3 tools/forks/make_deeplab_goldens.py

The files are those of tests/fork_golden/segnet (its README; fork_goldens.run_net_case writes
them); SegAccuracy's cases also hold the forwards before the last (forward<k>/), whose
confusion matrix the layer keeps without ``reset``; MatWrite's files go to mat/, where
MatRead's case reads them. Naming cases rewrites only those.
"""
import pathlib
import sys
import zlib

from fork_goldens import caffe, inputs_text, run_data_case, run_net_case, write_pairs
import numpy as np

OUT = pathlib.Path(__file__).resolve().parents[2] / 'tests' / 'fork_golden' / 'deeplab'


def interp_net(shape, interp):
    return ('name: "interp"\nforce_backward: true\n' + inputs_text({'x': shape})
            + 'layer { name: "interp" type: "Interp" bottom: "x" top: "y"\n'
              '  interp_param { %s } }\n' % interp)


def normal(shape):
    return lambda rs: {'x': rs.standard_normal(shape).astype(np.float32)}


SCORES = (2, 4, 5, 7)


def seg_accuracy_net(param):
    return ('name: "seg_accuracy"\n'
            + inputs_text({'score': SCORES, 'label': (SCORES[0], 1) + SCORES[2:]})
            + 'layer { name: "accuracy" type: "SegAccuracy" bottom: "score" bottom: "label" '
              'top: "accuracy"\n  seg_accuracy_param { %s } }\n' % param)


def scores_and_labels(rs):
    """Scores of few levels, so that ties are common (they go to the highest class), and
    labels without class 2 (its recall is left out, its Jaccard counts 1), some 255 or 254."""
    score = rs.randint(0, 3, SCORES).astype(np.float32)
    label = rs.choice([0, 1, 3], (SCORES[0], 1) + SCORES[2:]).astype(np.float32)
    label.flat[rs.choice(label.size, 8, replace=False)] = rs.choice([254, 255], 8)
    return {'score': score, 'label': label}


MAT_FILES = 'prefix: "mat/" source: "mat/names.txt" strip: 4'
MAT_WRITE = ('name: "mat_write"\n' + inputs_text({'x': (1, 3, 4, 5)})
             + 'layer { name: "write" type: "MatWrite" bottom: "x"\n'
               '  mat_write_param { %s } }\n' % MAT_FILES)


def net_cases():
    """name -> (prototxt, phase, input functions of a RandomState, one per forward)."""
    return {
        'interp_zoom': (interp_net((2, 3, 5, 7), 'zoom_factor: 3'), 'TRAIN',
                        [normal((2, 3, 5, 7))]),
        'interp_shrink': (interp_net((2, 3, 13, 19), 'shrink_factor: 2'), 'TRAIN',
                          [normal((2, 3, 13, 19))]),
        'interp_size': (interp_net((2, 3, 5, 7), 'height: 9 width: 4'), 'TRAIN',
                        [normal((2, 3, 5, 7))]),
        'interp_shrink_zoom_crop': (
            interp_net((2, 3, 11, 13), 'shrink_factor: 2 zoom_factor: 3 pad_beg: -1 pad_end: -2'),
            'TRAIN', [normal((2, 3, 11, 13))]),
        'seg_accuracy': (seg_accuracy_net('ignore_label: 255 ignore_label: 254'), 'TEST',
                         [scores_and_labels]),
        'seg_accuracy_kept_over_forwards': (
            seg_accuracy_net('ignore_label: 255 ignore_label: 254 reset: false'), 'TEST',
            [scores_and_labels] * 3),
        'mat_write': (MAT_WRITE, 'TEST', [normal((1, 3, 4, 5))] * 3),
    }


def seg_data_net(param, transform):
    return ('name: "seg_data"\nlayer { name: "data" type: "ImageSegData" top: "data" top: "label"'
            ' top: "data_dim"\n  image_data_param { source: "pairs/pairs.txt" root_folder: "pairs/"'
            ' label_type: PIXEL batch_size: 2 %s }\n  transform_param { %s } }\n'
            % (param, transform))


MEAN = 'mean_value: 104 mean_value: 117 mean_value: 123'
#: TEST's crops are centred and nothing is mirrored: the fork draws nothing
DATA_CASES = {
    'image_seg_data_padded': seg_data_net('ignore_label: 250', MEAN + ' crop_size: 10 scale: 0.5'),
    'image_seg_data_cropped': seg_data_net('', MEAN + ' crop_height: 4 crop_width: 6'),
    'image_seg_data_resized': seg_data_net('new_height: 5 new_width: 6', ''),
    'mat_read': 'name: "mat_read"\nlayer { name: "read" type: "MatRead" top: "x"\n' \
                '  mat_read_param { %s batch_size: 2 } }\n' % MAT_FILES,
}


def main(wanted):
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / 'mat').mkdir(exist_ok=True)
    (OUT / 'mat' / 'names.txt').write_text('a.jpg\nb.jpg\nc.jpg\n')
    caffe.set_mode_cpu()
    for name, (text, phase, make_inputs) in net_cases().items():
        if not wanted or name in wanted:
            run_net_case(OUT, name, text, phase, make_inputs, zlib.crc32(name.encode()))
            print('wrote', name)
    if not wanted or set(wanted) & set(DATA_CASES):
        write_pairs(OUT / 'pairs', np.random.RandomState(200))
        for name, text in DATA_CASES.items():
            if not wanted or name in wanted:
                run_data_case(OUT, name, text, ('x',) if name == 'mat_read'
                              else ('data', 'label', 'data_dim'))
                print('wrote', name)


if __name__ == '__main__':
    main(sys.argv[1:])
