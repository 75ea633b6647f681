#!/usr/bin/env python3
"""Write the SSD goldens of this folder by running the layers in the SSD fork of Caffe.

Run by hand with the fork's pycaffe (see README.md), never by the tests:

    PYTHONPATH=$HOME/caffe-ref/ssd-caffe/python python3 tests/ssd_golden/make_goldens.py

For each case it writes <case>.prototxt (the net the fork ran: Input layers feeding
the layer under test, or the whole detection net) and <case>.npz:
  data/<blob>            every blob after the forward
  topdiff/<blob>         the diff put on the tested layer's tops (backward cases)
  diff/<blob>            the diff of the tested layer's bottoms after the backward
  param/<i>, param_diff/<i>   the tested layer's learned blobs and their diffs
The mAP cases run the fork's solver test (eval_type "detection") and store its log's mAP.
"""
import os
import re
import struct
import subprocess
import sys
import tempfile
import zlib

import numpy as np

os.environ.setdefault('GLOG_minloglevel', '2')
import caffe  # noqa: E402  (the fork's pycaffe)
import mobilenet_ssd  # noqa: E402  (this folder's, the script's own directory)

HERE = os.path.dirname(os.path.abspath(__file__))
caffe.set_mode_cpu()
caffe.set_random_seed(1701)      # the fillers of Normalize's scale draw from Caffe's generator


def input_layers(shapes):
    return ''.join('layer { name: "%s" type: "Input" top: "%s" input_param { shape { %s } } }\n'
                   % (name, name, ' '.join('dim: %d' % d for d in shape))
                   for name, shape in shapes)


def save(name, prototxt, arrays):
    if prototxt is not None:
        with open(os.path.join(HERE, name + '.prototxt'), 'w') as f:
            f.write(prototxt)
    np.savez_compressed(os.path.join(HERE, name + '.npz'), **arrays)
    print('%-34s %s' % (name, ', '.join('%s%s' % (k, v.shape) for k, v in sorted(arrays.items()))))


def layer_case(name, layer_text, inputs, backward, seed, force_backward=True):
    """One layer fed by Input layers; ``inputs`` maps bottom name -> array. A backward
    case forces the backward unless the layer's own propagate_down says what learns."""
    rs = np.random.RandomState(seed)
    prototxt = ('name: "%s"\n' % name
                + ('force_backward: true\n' if backward and force_backward else '')
                + input_layers([(k, v.shape) for k, v in inputs.items()]) + layer_text)
    with tempfile.NamedTemporaryFile('w', suffix='.prototxt', delete=False) as f:
        f.write(prototxt)
    net = caffe.Net(f.name, caffe.TEST)
    os.unlink(f.name)
    for k, v in inputs.items():
        net.blobs[k].data[...] = v
    net.forward()
    out = {'data/' + k: net.blobs[k].data.copy() for k in net.blobs}
    tested = net.layers[-1]
    top_names = [k for k in net.top_names[net._layer_names[-1]]]
    for i, blob in enumerate(tested.blobs):
        out['param/%d' % i] = blob.data.copy()
    if backward:
        for top in top_names:
            diff = rs.standard_normal(net.blobs[top].data.shape).astype(np.float32)
            net.blobs[top].diff[...] = diff
            out['topdiff/' + top] = diff
        net.backward()
        for k in set(inputs) | set(net.bottom_names[net._layer_names[-1]]):
            out['diff/' + k] = net.blobs[k].diff.copy()
        for i, blob in enumerate(tested.blobs):
            out['param_diff/%d' % i] = blob.diff.copy()
    save(name, prototxt, out)


def permute_cases():
    rs = np.random.RandomState(1)
    x = rs.standard_normal((2, 3, 4, 5)).astype(np.float32)
    layer_case('permute_nhwc', 'layer { name: "p" type: "Permute" bottom: "x" top: "y" '
               'permute_param { order: 0 order: 2 order: 3 order: 1 } }\n', {'x': x}, True, 2)
    x = rs.standard_normal((2, 3, 4)).astype(np.float32)
    layer_case('permute_partial_order', 'layer { name: "p" type: "Permute" bottom: "x" top: "y" '
               'permute_param { order: 1 } }\n', {'x': x}, True, 3)


def normalize_cases():
    rs = np.random.RandomState(4)
    x = rs.standard_normal((2, 4, 3, 5)).astype(np.float32)
    cases = [
        ('normalize_defaults', 'norm_param { scale_filler { type: "constant" value: 2.5 } }'),
        ('normalize_per_position_uniform_scale',
         'norm_param { across_spatial: false channel_shared: false '
         'scale_filler { type: "constant" value: 20 } }'),
        ('normalize_per_position_varied_scale',
         'norm_param { across_spatial: false channel_shared: false eps: 0.001 '
         'scale_filler { type: "uniform" min: 0.5 max: 3 } }'),
        ('normalize_across_spatial_varied_scale',
         'norm_param { channel_shared: false scale_filler { type: "uniform" min: 0.5 max: 3 } }'),
    ]
    for seed, (name, param) in enumerate(cases, 10):
        layer_case(name, 'layer { name: "n" type: "Normalize" bottom: "x" top: "y" %s }\n'
                   % param, {'x': x}, True, seed)


def prior_box_cases():
    cases = [
        ('prior_box_mobilenet_ssd', (1, 8, 5, 5), (1, 3, 300, 300),
         'min_size: 60 max_size: 105 aspect_ratio: 2 aspect_ratio: 3 flip: true clip: false '
         'variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 offset: 0.5'),
        ('prior_box_truncated_sizes_steps', (2, 4, 3, 4), (2, 3, 100, 150),
         'min_size: 30.7 max_size: 45.9 aspect_ratio: 2 aspect_ratio: 0.5 aspect_ratio: 1 '
         'flip: true clip: true variance: 0.2 img_h: 90 img_w: 120 step: 28 offset: 0.3'),
        ('prior_box_two_sizes_no_flip', (1, 2, 2, 3), (1, 3, 64, 64),
         'min_size: 10 min_size: 20 max_size: 20 max_size: 40 aspect_ratio: 3 flip: false '
         'step_h: 30 step_w: 20'),
        ('prior_box_default_variance', (1, 2, 3, 3), (1, 3, 50, 40), 'min_size: 16'),
        ('prior_box_img_size_clip', (1, 2, 4, 4), (1, 3, 40, 60),
         'min_size: 64 max_size: 90 aspect_ratio: 3 img_size: 128 clip: true offset: 0'),
    ]
    for name, feature, image, param in cases:    # only the bottoms' shapes matter
        layer_case(name, 'layer { name: "pb" type: "PriorBox" bottom: "feature" bottom: "image" '
                   'top: "priors" prior_box_param { %s } }\n' % param,
                   {'feature': np.zeros(feature, np.float32),
                    'image': np.zeros(image, np.float32)}, False, 0)


def clustered_priors(rs, count):
    """Priors around a few centres, so that decoded boxes overlap and NMS has work."""
    centres = rs.uniform(0.2, 0.8, (6, 2))[rs.randint(0, 6, count)]
    centres += rs.normal(0, 0.03, centres.shape)
    sizes = rs.uniform(0.1, 0.4, (count, 2))
    boxes = np.concatenate([centres - sizes / 2, centres + sizes / 2], axis=1)
    variances = np.tile([0.1, 0.1, 0.2, 0.2], (count, 1))
    return np.stack([boxes.reshape(-1), variances.reshape(-1)])[None].astype(np.float32)


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def detection_output_cases():
    rs = np.random.RandomState(6)
    num, priors, classes = 2, 150, 5
    cases = [
        ('detection_output_center_size', True, 1.5,
         'num_classes: 5 share_location: true background_label_id: 0 '
         'nms_param { nms_threshold: 0.45 top_k: 60 } code_type: CENTER_SIZE '
         'keep_top_k: 40 confidence_threshold: 0.25'),
        ('detection_output_corner_per_class_eta', False, 1.5,
         'num_classes: 5 share_location: false background_label_id: -1 '
         'nms_param { nms_threshold: 0.8 eta: 0.7 } code_type: CORNER '
         'variance_encoded_in_target: true confidence_threshold: 0.3'),
        ('detection_output_corner_size_keep_top_k', True, 1.0,
         'num_classes: 5 background_label_id: 2 nms_param { nms_threshold: 0.5 } '
         'code_type: CORNER_SIZE keep_top_k: 7'),
        ('detection_output_nothing_found', True, 0.1,
         'num_classes: 5 nms_param { nms_threshold: 0.45 } code_type: CENTER_SIZE '
         'confidence_threshold: 0.9'),
    ]
    for name, shared, spread, param in cases:
        loc_classes = 1 if shared else classes
        loc = (rs.standard_normal((num, priors * loc_classes * 4)) * 0.5).astype(np.float32)
        if 'CORNER' in param and 'variance_encoded_in_target: true' in param:
            loc *= 0.05
        conf = softmax(rs.standard_normal((num, priors, classes)) * spread * 2)
        layer_case(name, 'layer { name: "det" type: "DetectionOutput" bottom: "loc" '
                   'bottom: "conf" bottom: "priors" top: "detections" '
                   'detection_output_param { %s } }\n' % param,
                   {'loc': loc, 'conf': conf.reshape(num, -1).astype(np.float32),
                    'priors': clustered_priors(rs, priors)}, False, 0)


def evaluation_inputs(rs, images, classes):
    """Detections (1, 1, D, 7) and ground truth (1, 1, G, 8) with the cases that matter:
    duplicates of one box, difficult boxes, labels and images without ground truth."""
    truth, found = [], []
    for image in range(images):
        for _ in range(rs.randint(1, 5)):
            label = rs.randint(1, classes)
            xy = rs.uniform(0, 0.6, 2)
            box = np.concatenate([xy, xy + rs.uniform(0.1, 0.4, 2)])
            difficult = float(rs.rand() < 0.25)
            truth.append([image, label, 0] + list(box) + [difficult])
            for _ in range(rs.randint(0, 4)):       # near copies: one tp, then fps
                jitter = rs.normal(0, 0.04, 4)
                found.append([image, label, rs.rand()] + list(box + jitter))
        for _ in range(rs.randint(0, 3)):            # strays, some on labels without truth
            xy = rs.uniform(0, 0.7, 2)
            found.append([image, rs.randint(1, classes), rs.rand()] + list(xy) + list(xy + 0.2))
    found.append([images, 1, 0.5, 0.1, 0.1, 0.3, 0.3])   # an image with no truth at all
    truth.append([-1] * 8)                                # ends the list: what follows is ignored
    truth.append([0, 1, 0, 0.1, 0.1, 0.3, 0.3, 0])
    det = np.array(found, np.float32)[None, None]
    gt = np.array(truth, np.float32)[None, None]
    return det, gt


def detection_evaluate_cases():
    rs = np.random.RandomState(7)
    det, gt = evaluation_inputs(rs, 4, 4)
    for name, param in [('detection_evaluate_difficult_counted',
                         'num_classes: 4 background_label_id: 0 overlap_threshold: 0.5'),
                        ('detection_evaluate_difficult_ignored',
                         'num_classes: 4 overlap_threshold: 0.4 evaluate_difficult_gt: false')]:
        layer_case(name, 'layer { name: "eval" type: "DetectionEvaluate" bottom: "det" '
                   'bottom: "gt" top: "eval" detection_evaluate_param { %s } }\n' % param,
                   {'det': det, 'gt': gt}, False, 0)


MAP_LAYER = '''
import numpy as np
import caffe


class Batches(caffe.Layer):
    """Top 0 / 1: the detections and ground truth of test iteration i (from a .npz)."""

    def setup(self, bottom, top):
        self.arrays = np.load(self.param_str)
        self.iteration = 0

    def reshape(self, bottom, top):
        i = self.iteration % int(self.arrays['iterations'])
        top[0].reshape(*self.arrays['det%d' % i].shape)
        top[1].reshape(*self.arrays['gt%d' % i].shape)

    def forward(self, bottom, top):
        i = self.iteration % int(self.arrays['iterations'])
        top[0].data[...] = self.arrays['det%d' % i]
        top[1].data[...] = self.arrays['gt%d' % i]
        self.iteration += 1

    def backward(self, top, propagate_down, bottom):
        pass
'''


def map_cases():
    """mAP by the fork's solver over 3 test iterations, for each ap_version."""
    rs = np.random.RandomState(8)
    work = tempfile.mkdtemp()
    arrays = {'iterations': np.array(3)}
    for i in range(3):
        arrays['det%d' % i], arrays['gt%d' % i] = evaluation_inputs(rs, 3, 5)
    batches = os.path.join(work, 'batches.npz')
    np.savez(batches, **arrays)
    with open(os.path.join(work, 'map_layer.py'), 'w') as f:
        f.write(MAP_LAYER)
    evaluate = 'num_classes: 6 overlap_threshold: 0.5 evaluate_difficult_gt: false'
    test_net = ('name: "map"\nlayer { name: "batches" type: "Python" top: "det" top: "gt" '
                'python_param { module: "map_layer" layer: "Batches" param_str: "%s" } }\n'
                'layer { name: "eval" type: "DetectionEvaluate" bottom: "det" bottom: "gt" '
                'top: "eval" detection_evaluate_param { %s } }\n' % (batches, evaluate))
    train_net = ('name: "train"\nlayer { name: "x" type: "DummyData" top: "x" dummy_data_param '
                 '{ shape { dim: 1 dim: 1 } } }\nlayer { name: "ip" type: "InnerProduct" '
                 'bottom: "x" top: "y" inner_product_param { num_output: 1 } }\nlayer { '
                 'name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "x" top: "loss" }\n')
    for name, text in (('train.prototxt', train_net), ('test.prototxt', test_net)):
        with open(os.path.join(work, name), 'w') as f:
            f.write(text)
    maps = {}
    for version in ('11point', 'MaxIntegral', 'Integral'):
        solver = os.path.join(work, 'solver_%s.prototxt' % version)
        with open(solver, 'w') as f:
            f.write('train_net: "%s/train.prototxt"\ntest_net: "%s/test.prototxt"\n'
                    'test_iter: 3\ntest_interval: 1\ntest_initialization: true\nbase_lr: 0\n'
                    'max_iter: 1\nlr_policy: "fixed"\ndisplay: 0\nsnapshot_after_train: false\n'
                    'eval_type: "detection"\nap_version: "%s"\nshow_per_class_result: true\n'
                    % (work, work, version))
        script = ('import caffe; caffe.set_mode_cpu(); s = caffe.get_solver(%r); s.step(1)'
                  % solver)
        env = dict(os.environ, GLOG_minloglevel='0', GLOG_logtostderr='1',
                   PYTHONPATH=work + os.pathsep + os.environ.get('PYTHONPATH', ''))
        log = subprocess.run([sys.executable, '-c', script], env=env, cwd=work,
                             capture_output=True, text=True).stderr
        means = re.findall(r'Test net output #0: eval = ([-0-9.e]+)', log)
        per_class = re.findall(r'class(\d+): ([-0-9.e]+)', log)
        if not means:
            sys.exit('no mAP in the solver log:\n' + log[-3000:])
        maps['map/' + version] = np.array(float(means[0]))
        for label, ap in per_class[:len(per_class)]:
            maps['ap/%s/%s' % (version, label)] = np.array(float(ap))
    out = dict(maps)
    for i in range(3):
        out['det%d' % i], out['gt%d' % i] = arrays['det%d' % i], arrays['gt%d' % i]
    save('detection_map', test_net.replace(batches, 'batches.npz') + '# solver: eval_type '
         '"detection", test_iter 3\n', out)


def net_case():
    """The small MobileNet-SSD-like deploy net, random weights, two images."""
    proto = os.path.join(HERE, 'mini_ssd_deploy.prototxt')
    net = caffe.Net(proto, caffe.TEST)
    rs = np.random.RandomState(9)
    for name, blobs in net.params.items():
        kind = net.layers[list(net._layer_names).index(name)].type
        for i, blob in enumerate(blobs):
            if kind == 'BatchNorm':
                values = [rs.normal(0, 0.2, blob.data.shape), rs.uniform(0.5, 2, blob.data.shape),
                          np.ones(blob.data.shape)][i]
            elif kind == 'Scale':
                values = rs.uniform(0.5, 1.5, blob.data.shape) if i == 0 else \
                    rs.normal(0, 0.1, blob.data.shape)
            elif kind == 'Normalize':
                values = rs.uniform(5, 15, blob.data.shape)
            else:
                fan_in = max(1, int(np.prod(blob.data.shape[1:])))
                values = rs.normal(0, np.sqrt(2.0 / fan_in), blob.data.shape)
            blob.data[...] = values
    net.save(os.path.join(HERE, 'mini_ssd.caffemodel'))
    image = rs.uniform(-1, 1, net.blobs['data'].data.shape).astype(np.float32)
    net.blobs['data'].data[...] = image
    net.forward()
    keep = ['data', 'mbox_loc', 'mbox_conf_flatten', 'mbox_priorbox', 'detection_out']
    out = {'data/' + k: net.blobs[k].data.copy() for k in keep}
    save('mini_ssd', None, out)      # its net is mini_ssd_deploy.prototxt
    print('   detections:', out['data/detection_out'].shape)


def multibox_ground_truth(rs, images, classes, background):
    """(1, 1, G, 8) rows: images with several boxes, one without any, a difficult box
    and an item id -1 row in the middle, which the fork skips (it does not end the list)."""
    rows = []
    for image in range(images - 1):
        for _ in range(rs.randint(2, 5)):
            xy = rs.uniform(0.05, 0.6, 2)
            box = np.concatenate([xy, xy + rs.uniform(0.15, 0.35, 2)])
            label = rs.choice([c for c in range(classes) if c != background])
            rows.append([image, label, len(rows)] + list(box)
                        + [float(rs.rand() < 0.2)])
        if image == 0:
            rows.append([-1, 0, 0, 0, 0, 0, 0, 0])
    return np.array(rows, np.float32)[None, None]


MULTIBOX_CASES = [   # name, classes, shared location, multibox_loss_param, extra layer text
    ('multibox_loss_max_negative_center_size', 4, True,
     'code_type: CENTER_SIZE overlap_threshold: 0.4', ''),
    ('multibox_loss_bipartite_l2_full', 4, True,
     'match_type: BIPARTITE loc_loss_type: L2 code_type: CORNER use_difficult_gt: false '
     'neg_pos_ratio: 2 loc_weight: 0.7', 'loss_param { normalization: FULL } '),
    ('multibox_loss_logistic_batch_size', 3, True,
     'conf_loss_type: LOGISTIC code_type: CORNER_SIZE ignore_cross_boundary_bbox: true '
     'overlap_threshold: 0.3', 'loss_param { normalization: BATCH_SIZE } '),
    ('multibox_loss_per_class_no_mining', 4, False,
     'share_location: false mining_type: NONE use_prior_for_matching: false '
     'background_label_id: 2 code_type: CENTER_SIZE overlap_threshold: 0.3',
     'loss_param { normalization: NONE } '),
    ('multibox_loss_hard_example_bp_inside', 4, True,
     'mining_type: HARD_EXAMPLE sample_size: 12 bp_inside: true use_prior_for_matching: false '
     'code_type: CENTER_SIZE overlap_threshold: 0.35', ''),
    ('multibox_loss_conf_only', 4, True, 'code_type: CENTER_SIZE neg_pos_ratio: 1.5',
     'propagate_down: false '),
    ('multibox_loss_variance_in_target', 4, True,
     'code_type: CORNER encode_variance_in_target: true overlap_threshold: 0.3', ''),
]


def multibox_loss_cases():
    rs = np.random.RandomState(9)
    images, priors = 3, 80
    for name, classes, shared, param, extra in MULTIBOX_CASES:
        loc_classes = 1 if shared else classes
        background = int(re.search(r'background_label_id: (\d+)', param + ' background_label_id: 0')
                         .group(1))
        propagate = ('propagate_down: true ' if 'propagate_down' not in extra else '')
        # the fork backpropagates into a loss only from blobs that need a gradient: loc and
        # conf pass through Scale layers whose one weight (1) learns, which Input tops do not
        # (the Scale layers' own bottoms get no gradient: diff/loc_in is scratch, diff/loc is
        # the loss's gradient)
        layer_text = ''.join(
            'layer { name: "%s" type: "Scale" bottom: "%s_in" top: "%s" '
            'scale_param { axis: 0 num_axes: 0 filler { type: "constant" value: 1 } } }\n'
            % (blob, blob, blob) for blob in ('loc', 'conf'))
        layer_text += ('layer { name: "mbox_loss" type: "MultiBoxLoss" bottom: "loc" '
                       'bottom: "conf" bottom: "priors" bottom: "label" top: "loss" %s%s'
                       'propagate_down: true propagate_down: false propagate_down: false '
                       'multibox_loss_param { num_classes: %d %s } }\n'
                       % (extra, propagate, classes, param))
        inputs = {'loc_in': (rs.standard_normal((images, priors * loc_classes * 4)) * 0.3
                             ).astype(np.float32),
                  'conf_in': (rs.standard_normal((images, priors * classes)) * 2
                              ).astype(np.float32),
                  'priors': clustered_priors(rs, priors),
                  'label': multibox_ground_truth(rs, images, classes, background)}
        layer_case(name, layer_text, inputs, True, 10, force_backward=False)


def write_png(path, image):
    """An H x W x 3 BGR uint8 image as a PNG file (the fork's Python has no image library)."""
    height, width = image.shape[:2]
    rgb = image[..., ::-1]
    raw = b''.join(b'\x00' + rgb[y].tobytes() for y in range(height))

    def chunk(tag, data):
        return (struct.pack('>I', len(data)) + tag + data
                + struct.pack('>I', zlib.crc32(tag + data) & 0xffffffff))
    with open(path, 'wb') as f:
        f.write(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', width, height,
                                                                     8, 2, 0, 0, 0))
                + chunk(b'IDAT', zlib.compress(raw)) + chunk(b'IEND', b''))


VOC_OBJECT = ('<object><name>%s</name><difficult>%d</difficult><bndbox><xmin>%d</xmin>'
              '<ymin>%d</ymin><xmax>%d</xmax><ymax>%d</ymax></bndbox></object>')
ANNOSET_NAMES = ('circle', 'square', 'triangle')
ANNOTATED_DATA_CASES = [   # name, LMDB, batch size, transform_param
    ('annotated_data_xml_center_crop', 'fork_xml_lmdb', 3,
     'crop_size: 32 mean_value: 10 mean_value: 20 mean_value: 30 scale: 0.5'),
    ('annotated_data_txt_warp', 'fork_txt_lmdb', 3,
     'resize_param { resize_mode: WARP height: 36 width: 44 } '
     'emit_constraint { emit_type: CENTER }'),
]


def annoset_files(rs, folder):
    """Images, VOC xml and txt annotations, lists and a label map in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, 'labelmap.prototxt'), 'w') as f:
        f.write('item { name: "none_of_the_above" label: 0 display_name: "background" }\n')
        for label, name in enumerate(ANNOSET_NAMES, 1):
            f.write('item { name: "%s" label: %d display_name: "%s" }\n' % (name, label, name))
    xml_list, txt_list = [], []
    for i in range(4):                         # 40 x 48 images with VOC annotations
        write_png(os.path.join(folder, 'voc_%d.png' % i),
                  rs.randint(0, 256, (40, 48, 3)).astype(np.uint8))
        xml_list.append('voc_%d.png voc_%d.xml' % (i, i))
        if i == 3:
            continue                           # no annotation file: an image without boxes
        objects = []
        for k in range(3):
            x, y = rs.randint(0, 30), rs.randint(0, 24)
            objects.append(VOC_OBJECT % (ANNOSET_NAMES[rs.randint(3)], int(k == 1), x, y,
                                         x + rs.randint(6, 24), y + rs.randint(6, 20)))
        if i == 0:                             # past the right edge: clipped by the layer
            objects.append(VOC_OBJECT % ('square', 0, 40, 10, 55, 30))
        if i == 1:                             # difficult after bndbox: not difficult
            objects.append('<object><name>circle</name><bndbox><xmin>3</xmin><ymin>4</ymin>'
                           '<xmax>20</xmax><ymax>25</ymax></bndbox><difficult>1</difficult>'
                           '</object>')
        with open(os.path.join(folder, 'voc_%d.xml' % i), 'w') as f:
            f.write('<annotation><size><width>48</width><height>40</height><depth>3</depth>'
                    '</size>%s</annotation>\n' % ''.join(objects))
    for i, (height, width) in enumerate([(30, 50), (44, 36), (40, 40)]):
        write_png(os.path.join(folder, 'txt_%d.png' % i),
                  rs.randint(0, 256, (height, width, 3)).astype(np.uint8))
        txt_list.append('txt_%d.png txt_%d.txt' % (i, i))
        with open(os.path.join(folder, 'txt_%d.txt' % i), 'w') as f:
            for _ in range(2 + i):
                x, y = rs.uniform(0, width * 0.6), rs.uniform(0, height * 0.6)
                f.write('%d %.2f %.2f %.2f %.2f\n' % (rs.randint(1, 4), x, y,
                                                     x + rs.uniform(4, width * 0.4),
                                                     y + rs.uniform(4, height * 0.4)))
    for name, lines in (('xml_list.txt', xml_list), ('txt_list.txt', txt_list)):
        with open(os.path.join(folder, name), 'w') as f:
            f.write('\n'.join(lines) + '\n')


def annotated_data_cases():
    folder = os.path.join(HERE, 'annoset')
    annoset_files(np.random.RandomState(11), folder)
    tool = os.path.expanduser('~/caffe-ref/ssd-caffe/build/tools/convert_annoset')
    for lmdb, label_type, extra in (('fork_xml_lmdb', 'xml', []),
                                    ('fork_txt_lmdb', 'txt', ['--encoded', '--encode_type=png'])):
        target = os.path.join(folder, lmdb)
        subprocess.run(['rm', '-rf', target], check=True)
        subprocess.run([tool, '--anno_type=detection', '--label_type=' + label_type,
                        '--label_map_file=' + os.path.join(folder, 'labelmap.prototxt')]
                       + extra + [folder + '/', os.path.join(folder, label_type + '_list.txt'),
                                  target], check=True, capture_output=True)
        subprocess.run(['rm', '-f', os.path.join(target, 'lock.mdb')], check=True)
    for name, lmdb, batch, transform in ANNOTATED_DATA_CASES:
        prototxt = ('name: "%s"\nlayer { name: "data" type: "AnnotatedData" top: "data" '
                    'top: "label" include { phase: TEST } transform_param { %s } '
                    'data_param { source: "annoset/%s" batch_size: %d backend: LMDB } '
                    'annotated_data_param { label_map_file: "annoset/labelmap.prototxt" } }\n'
                    % (name, transform, lmdb, batch))
        cwd = os.getcwd()
        os.chdir(HERE)                    # the sources are relative to this folder
        with tempfile.NamedTemporaryFile('w', suffix='.prototxt', delete=False) as f:
            f.write(prototxt)
        net = caffe.Net(f.name, caffe.TEST)
        os.unlink(f.name)
        out = {}
        for step in range(2):            # the second batch wraps around the records
            net.forward()
            out['data/%d' % step] = net.blobs['data'].data.copy()
            out['label/%d' % step] = net.blobs['label'].data.copy()
        del net
        os.chdir(cwd)
        subprocess.run(['rm', '-f', os.path.join(folder, lmdb, 'lock.mdb')], check=True)
        save(name, prototxt, out)


SOLVER_NET = """name: "solver_tiny_ssd"
layer { name: "data" type: "AnnotatedData" top: "data" top: "label"
        transform_param { scale: 0.0078125 mean_value: 127.5 }
        data_param { source: "annoset/fork_xml_lmdb" batch_size: 2 backend: LMDB }
        annotated_data_param { label_map_file: "annoset/labelmap.prototxt" } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 8 kernel_size: 3 stride: 4 pad: 1
                            weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "loc" type: "Convolution" bottom: "conv" top: "loc"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loc_perm" type: "Permute" bottom: "loc" top: "loc_perm"
        permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "loc_flat" type: "Flatten" bottom: "loc_perm" top: "loc_flat" }
layer { name: "conf" type: "Convolution" bottom: "conv" top: "conf"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "conf_perm" type: "Permute" bottom: "conf" top: "conf_perm"
        permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "conf_flat" type: "Flatten" bottom: "conf_perm" top: "conf_flat" }
layer { name: "priors" type: "PriorBox" bottom: "conv" bottom: "data" top: "priors"
        prior_box_param { min_size: 10 max_size: 20 variance: 0.1 variance: 0.1
                          variance: 0.2 variance: 0.2 } }
layer { name: "loss" type: "MultiBoxLoss" bottom: "loc_flat" bottom: "conf_flat"
        bottom: "priors" bottom: "label" top: "loss"
        propagate_down: true propagate_down: true propagate_down: false propagate_down: false
        multibox_loss_param { num_classes: 4 overlap_threshold: 0.3 code_type: CENTER_SIZE } }
"""
SOLVER = ('net: "solver_tiny_ssd.prototxt" base_lr: 0.05 momentum: 0.9 weight_decay: 0.0005 '
          'lr_policy: "fixed" max_iter: 5 display: 0 snapshot: 0 snapshot_after_train: false\n')
SOLVER_STEPS = 5


def solver_case():
    """5 iterations of the fork's SGD solver on a tiny SSD (AnnotatedData without
    augmentations, BatchNorm + Scale, MultiBoxLoss): the initial weights, the loss of each
    iteration and the weights after the last."""
    cwd = os.getcwd()
    os.chdir(HERE)                        # the net's sources are relative to this folder
    with open('solver_tiny_ssd.prototxt', 'w') as f:
        f.write(SOLVER_NET)
    with open('solver_tiny_ssd.solver.prototxt', 'w') as f:
        f.write(SOLVER)
    solver = caffe.SGDSolver('solver_tiny_ssd.solver.prototxt')
    solver.net.save('solver_tiny_ssd_init.caffemodel')
    out = {}
    for step in range(SOLVER_STEPS):
        solver.step(1)
        out['loss/%d' % step] = np.array(solver.net.blobs['loss'].data)
    for name, blobs in solver.net.params.items():
        for i, blob in enumerate(blobs):
            out['param_after/%s/%d' % (name, i)] = blob.data.copy()
    del solver
    subprocess.run(['rm', '-f', 'annoset/fork_xml_lmdb/lock.mdb'], check=True)
    os.chdir(cwd)
    save('solver_tiny_ssd', None, out)


MOBILENET_WEIGHT_SEED, MOBILENET_IMAGE_SEED = 0, 1
MOBILENET_BLOBS = ('conv16_2', 'conv17_2', 'mbox_loc', 'detection_out')


def mobilenet_ssd_case():
    """The full-size MobileNet-SSD of mobilenet_ssd.py on two images, its weights drawn from
    a seed: only the seeds and a few blobs are stored (the weights would be 23 MB)."""
    with tempfile.NamedTemporaryFile('w', suffix='.prototxt', delete=False) as f:
        f.write(mobilenet_ssd.prototxt())
    net = caffe.Net(f.name, caffe.TEST)
    os.unlink(f.name)
    for name, arrays in mobilenet_ssd.weights(MOBILENET_WEIGHT_SEED).items():
        for blob, array in zip(net.params[name], arrays):
            assert blob.data.shape == array.shape, (name, blob.data.shape, array.shape)
            blob.data[...] = array
    images = mobilenet_ssd.images(MOBILENET_IMAGE_SEED)
    net.blobs['data'].reshape(*images.shape)
    net.reshape()
    net.forward(data=images)
    out = {'data/' + name: net.blobs[name].data.copy() for name in MOBILENET_BLOBS}
    out['weight_seed'] = np.array(MOBILENET_WEIGHT_SEED)
    out['image_seed'] = np.array(MOBILENET_IMAGE_SEED)
    save('mobilenet_ssd', None, out)


GROUPS = {'permute': permute_cases, 'normalize': normalize_cases,
          'prior_box': prior_box_cases, 'detection_output': detection_output_cases,
          'detection_evaluate': detection_evaluate_cases, 'map': map_cases, 'net': net_case,
          'multibox_loss': multibox_loss_cases, 'annotated_data': annotated_data_cases,
          'solver': solver_case, 'mobilenet_ssd': mobilenet_ssd_case}


if __name__ == '__main__':
    # every group, or the groups named on the command line
    for group in sys.argv[1:] or list(GROUPS):
        GROUPS[group]()
