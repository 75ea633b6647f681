"""A full-size MobileNet-SSD deploy net (300x300, 21 classes) and its weights from a seed.

The architecture is that of chuanqi305/MobileNet-SSD (github.com/chuanqi305/MobileNet-SSD,
deploy.prototxt): a MobileNet v1 body (conv0, then conv1..conv13, each a depthwise 3x3
convolution and a pointwise 1x1 one, each followed by BatchNorm + Scale + ReLU), the extra
layers conv14_1..conv17_2, six heads (conv11, conv13, conv14_2..conv17_2) of 1x1 loc / conf
convolutions with Permute / Flatten and a PriorBox each, the Concats, the Softmax over the 21
classes and DetectionOutput (nms 0.45, top_k 100, keep_top_k 100, confidence_threshold 0.01 as
in that repo's test net). The text is written here, not copied: only the layer sizes and
settings are that net's.

The weights are not stored: ``weights(seed)`` draws them from numpy's RandomState (stable
across numpy versions), so the fork's pycaffe (make_goldens.py) and the tests get the same
arrays. Their scales keep the activations near unit size through the 47 convolutions, and
the background class's bias makes most priors background, so that the detections (100 per
image, keep_top_k's limit) have varied labels and scores rather than softmax ties. Runs under the fork's Python and
ours: numpy only.
"""
import numpy as np

CLASSES = 21
IMAGE = 300
#: (name, output channels, stride of the depthwise convolution) of conv1..conv13
BODY = [('conv1', 64, 1), ('conv2', 128, 2), ('conv3', 128, 1), ('conv4', 256, 2),
        ('conv5', 256, 1), ('conv6', 512, 2), ('conv7', 512, 1), ('conv8', 512, 1),
        ('conv9', 512, 1), ('conv10', 512, 1), ('conv11', 512, 1), ('conv12', 1024, 2),
        ('conv13', 1024, 1)]
#: the extra layers: (1x1 name, its outputs, 3x3 stride-2 name, its outputs)
EXTRAS = [('conv14_1', 256, 'conv14_2', 512), ('conv15_1', 128, 'conv15_2', 256),
          ('conv16_1', 128, 'conv16_2', 256), ('conv17_1', 64, 'conv17_2', 128)]
#: the heads: (source, min_size, max_size or None, aspect ratios besides 1)
HEADS = [('conv11', 60, None, (2,)), ('conv13', 105, 150, (2, 3)),
         ('conv14_2', 150, 195, (2, 3)), ('conv15_2', 195, 240, (2, 3)),
         ('conv16_2', 240, 285, (2, 3)), ('conv17_2', 285, 300, (2, 3))]
#: logit added to the background class of every prior
BACKGROUND_BIAS = 5.0
#: the heads' weights are gain / sqrt(fan_in) times a standard normal: the head inputs have a
#: second moment between 3 and 7, so the loc offsets come out near unit size and the logits
#: spread by about 1.7
LOC_GAIN, CONF_GAIN = 0.4, 0.7


def boxes_per_cell(max_size, ratios):
    # ratio 1, the sqrt(min*max) square, then each ratio and its flip
    return 1 + (max_size is not None) + 2 * len(ratios)


class _Writer:
    def __init__(self):
        self.text = ['name: "MobileNet-SSD"\n', 'input: "data"\n',
                     'input_shape { dim: 1 dim: 3 dim: %d dim: %d }\n' % (IMAGE, IMAGE)]
        self.params = []          # (layer name, kind, shapes)
        self.channels = {'data': 3}

    def layer(self, body):
        self.text.append('layer { %s }\n' % body)

    def conv(self, name, bottom, outputs, kernel, stride=1, group=1, bias=False):
        pad = kernel // 2
        self.layer('name: "%s" type: "Convolution" bottom: "%s" top: "%s" convolution_param { '
                   'num_output: %d bias_term: %s pad: %d kernel_size: %d stride: %d group: %d }'
                   % (name, bottom, name, outputs, 'true' if bias else 'false', pad, kernel,
                      stride, group))
        shapes = [(outputs, self.channels[bottom] // group, kernel, kernel)]
        self.params.append((name, 'head' if bias else 'conv',
                            shapes + ([(outputs,)] if bias else [])))
        self.channels[name] = outputs

    def bn_scale_relu(self, name):
        c = self.channels[name]
        self.layer('name: "%s/bn" type: "BatchNorm" bottom: "%s" top: "%s"' % (name, name, name))
        self.params.append((name + '/bn', 'bn', [(c,), (c,), (1,)]))
        self.layer('name: "%s/scale" type: "Scale" bottom: "%s" top: "%s" '
                   'scale_param { bias_term: true }' % (name, name, name))
        self.params.append((name + '/scale', 'scale', [(c,), (c,)]))
        self.layer('name: "%s/relu" type: "ReLU" bottom: "%s" top: "%s"' % (name, name, name))

    def unit(self, name, bottom, outputs, kernel, stride=1, group=1):
        self.conv(name, bottom, outputs, kernel, stride, group)
        self.bn_scale_relu(name)

    def head(self, source, min_size, max_size, ratios):
        boxes = boxes_per_cell(max_size, ratios)
        for part, per_box in (('loc', 4), ('conf', CLASSES)):
            name = '%s_mbox_%s' % (source, part)
            self.conv(name, source, boxes * per_box, 1, bias=True)
            self.layer('name: "%s_perm" type: "Permute" bottom: "%s" top: "%s_perm" '
                       'permute_param { order: 0 order: 2 order: 3 order: 1 }' % (name, name, name))
            self.layer('name: "%s_flat" type: "Flatten" bottom: "%s_perm" top: "%s_flat" '
                       'flatten_param { axis: 1 }' % (name, name, name))
        sizes = 'min_size: %d ' % min_size + ('max_size: %d ' % max_size if max_size else '')
        self.layer('name: "%s_mbox_priorbox" type: "PriorBox" bottom: "%s" bottom: "data" '
                   'top: "%s_mbox_priorbox" prior_box_param { %s%s flip: true clip: false '
                   'variance: 0.1 variance: 0.1 variance: 0.2 variance: 0.2 offset: 0.5 }'
                   % (source, source, source, sizes,
                      ' '.join('aspect_ratio: %d' % r for r in ratios)))

    def concat(self, name, part, axis):
        bottoms = ' '.join('bottom: "%s_mbox_%s"' % (source, part) for source, *_ in HEADS)
        self.layer('name: "%s" type: "Concat" %s top: "%s" concat_param { axis: %d }'
                   % (name, bottoms, name, axis))


def _build():
    w = _Writer()
    w.unit('conv0', 'data', 32, 3, stride=2)
    previous = 'conv0'
    for name, outputs, stride in BODY:
        channels = w.channels[previous]
        w.unit(name + '/dw', previous, channels, 3, stride=stride, group=channels)
        w.unit(name, name + '/dw', outputs, 1)
        previous = name
    for first, first_out, second, second_out in EXTRAS:
        w.unit(first, previous, first_out, 1)
        w.unit(second, first, second_out, 3, stride=2)
        previous = second
    for head in HEADS:
        w.head(*head)
    w.concat('mbox_loc', 'loc_flat', 1)
    w.concat('mbox_conf', 'conf_flat', 1)
    w.concat('mbox_priorbox', 'priorbox', 2)
    w.layer('name: "mbox_conf_reshape" type: "Reshape" bottom: "mbox_conf" '
            'top: "mbox_conf_reshape" reshape_param { shape { dim: 0 dim: -1 dim: %d } }'
            % CLASSES)
    w.layer('name: "mbox_conf_softmax" type: "Softmax" bottom: "mbox_conf_reshape" '
            'top: "mbox_conf_softmax" softmax_param { axis: 2 }')
    w.layer('name: "mbox_conf_flatten" type: "Flatten" bottom: "mbox_conf_softmax" '
            'top: "mbox_conf_flatten" flatten_param { axis: 1 }')
    w.layer('name: "detection_out" type: "DetectionOutput" bottom: "mbox_loc" '
            'bottom: "mbox_conf_flatten" bottom: "mbox_priorbox" top: "detection_out" '
            'detection_output_param { num_classes: %d share_location: true '
            'background_label_id: 0 nms_param { nms_threshold: 0.45 top_k: 100 } '
            'code_type: CENTER_SIZE keep_top_k: 100 confidence_threshold: 0.01 }' % CLASSES)
    return ''.join(w.text), w.params


def prototxt():
    """The deploy net's text."""
    return _build()[0]


def weights(seed):
    """{layer name: [arrays]} of every learned blob, float32, drawn in the net's layer order."""
    rs = np.random.RandomState(seed)
    out = {}
    for name, kind, shapes in _build()[1]:
        if kind == 'conv':        # He's scale for the ReLU that follows
            fan_in = int(np.prod(shapes[0][1:]))
            arrays = [rs.standard_normal(shapes[0]) * np.sqrt(2.0 / fan_in)]
        elif kind == 'bn':        # running mean, variance and the scale factor (1)
            c = shapes[0][0]
            arrays = [rs.normal(0, 0.1, c), rs.uniform(0.5, 1.5, c), np.ones(1)]
        elif kind == 'scale':
            c = shapes[0][0]
            arrays = [rs.uniform(0.8, 1.2, c), rs.normal(0.1, 0.2, c)]
        else:                     # a head: loc offsets near unit size, logits spread by CONF_GAIN
            fan_in = int(np.prod(shapes[0][1:]))
            gain = CONF_GAIN if name.endswith('conf') else LOC_GAIN
            arrays = [rs.standard_normal(shapes[0]) * gain / np.sqrt(fan_in),
                      rs.normal(0, 0.1, shapes[1])]
            if name.endswith('conf'):
                arrays[1][::CLASSES] += BACKGROUND_BIAS
        out[name] = [a.astype(np.float32) for a in arrays]
    return out


def images(seed, count=2):
    """``count`` images (count, 3, 300, 300) in [-1, 1], the range of MobileNet-SSD's input
    ((pixel - 127.5) * 0.007843): random 30x30-pixel patches plus noise, so that the features
    vary in space."""
    rs = np.random.RandomState(seed)
    coarse = rs.uniform(-1, 1, (count, 3, 10, 10))
    fine = np.repeat(np.repeat(coarse, 30, axis=2), 30, axis=3)
    return np.clip(fine + rs.normal(0, 0.2, fine.shape), -1, 1).astype(np.float32)
