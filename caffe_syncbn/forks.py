"""Layer types and layer settings of well-known Caffe forks that this package does not
implement, so that a net using one is told where the layer comes from instead of
being offered the nearest name of another layer.

``FORK_LAYER_TYPES`` maps a layer type to the fork it comes from, ``FORK_PARAM_FIELDS``
a LayerParameter field (``*_param``, as a prototxt spells it) to its fork, and
``FORK_LAYER_INSTEAD`` a layer type to what this package runs in its place, where there
is something. ``FORK_SETTINGS`` maps a field inside any message of the schema
('Message.field') to its fork and what this package accepts instead, and
``FORK_REPEATED_SETTINGS`` a field that a fork repeats where the schema has one. A type or
field that gets implemented is removed here (the tests check both ways).
"""
import difflib

YOLO = 'the YOLO ports of Caffe'
RFCN = "R-FCN's Caffe"
SEGNET = "SegNet's Caffe"
SSD = "Wei Liu's SSD fork of Caffe"

FORK_LAYER_TYPES = {
    'RegionLoss': YOLO,
    'PSROIPooling': RFCN,
    'DenseImageData': SEGNET,
    'VideoData': SSD,
}

FORK_PARAM_FIELDS = {
    'psroi_pooling_param': RFCN,
    'dense_image_data_param': SEGNET,
}

# ---- eric612/MobileNet-YOLO's training and segmentation layers, caffe_ocr's DenseBlock ------
MOBILENET_YOLO = "eric612's MobileNet-YOLO"
CAFFE_OCR = "senlinuc's caffe_ocr"
_YOLO_LOSS = ('a training loss: train the net in its fork; its deploy net, which ends in '
              'YoloDetectionOutput or Yolov3DetectionOutput, runs here')
FORK_LAYER_TYPES.update({
    'Yolov3': MOBILENET_YOLO,
    'GaussianYolov3': MOBILENET_YOLO,
    'YoloSeg': MOBILENET_YOLO,
    'SegmentationEvaluate': MOBILENET_YOLO,
    'AssistedExcitation': MOBILENET_YOLO,
    'LaneData': MOBILENET_YOLO,
    'DenseBlock': CAFFE_OCR,
    'ReverseTime': CAFFE_OCR,
    'SoftmaxWithLossMultiLabel': CAFFE_OCR,
})
_TRAIN_IN_THE_FORK = 'train the net in its fork; its test and deploy nets run here'
FORK_LAYER_INSTEAD = {
    'RegionLoss': _YOLO_LOSS,
    'Yolov3': _YOLO_LOSS,
    'GaussianYolov3': _YOLO_LOSS,
    'YoloSeg': 'the loss of its segmentation head: ' + _TRAIN_IN_THE_FORK,
    'SegmentationEvaluate': 'an evaluation of its segmentation head: remove it',
    'AssistedExcitation': 'a training aid that reads the ground truth: ' + _TRAIN_IN_THE_FORK,
    'LaneData': 'a data layer of lane annotations: ' + _TRAIN_IN_THE_FORK,
    'DenseBlock': 'write its transitions out as BatchNorm, Scale, ReLU, Convolution and '
                  'Concat layers (caffe_ocr\'s ResNet and Inception-BN nets run here)',
    'ReverseTime': 'Reverse with axis 0 reverses the whole time axis, the same where '
                   'every sequence fills it',
    'SoftmaxWithLossMultiLabel': 'WarpCTCLoss trains the label sequences, as in caffe_ocr\'s '
                                 'ResNet and Inception-BN nets',
}

# ---- settings inside messages: MobileNet-YOLO's and caffe_ocr's --------------------------
_NO_AUGMENTATION = 'its data augmentation is not implemented: remove it'
_DETECTION_OCR_SETTINGS = {
    YOLO: {'LayerParameter': {'region_loss_param': _YOLO_LOSS}},
    MOBILENET_YOLO: {
        'LayerParameter': {'yolov3_param': _YOLO_LOSS,
                           'yolo_seg_param': FORK_LAYER_INSTEAD['YoloSeg'],
                           'segmentation_evaluate_param':
                               FORK_LAYER_INSTEAD['SegmentationEvaluate']},
        'TransformationParameter': {name: _NO_AUGMENTATION for name in (
            'enable_classf_aug', 'min_scaling_factor', 'max_scaling_factor',
            'max_rotation_angle', 'contrast_brightness_adjustment', 'smooth_filtering',
            'min_contrast', 'max_contrast', 'max_brightness_shift', 'max_smooth',
            'max_color_shift', 'min_side_min', 'min_side_max', 'min_side',
            'apply_probability', 'debug_params', 'cvt_bgr2rgb')},
        'AnnotatedDataParameter': {name: 'its YOLO data and segmentation labels are not '
                                         'implemented: remove it (AnnotatedData samples and '
                                         "distorts as the SSD fork)" for name in (
            'yolo_data_type', 'yolo_data_jitter', 'train_diffcult', 'single_class',
            'seg_scales', 'seg_resize_width', 'seg_resize_height', 'difficult_label_warmup')},
    },
    CAFFE_OCR: {
        'LayerParameter': {'denseblock_param': FORK_LAYER_INSTEAD['DenseBlock'],
                           'reverse_time_param': FORK_LAYER_INSTEAD['ReverseTime']},
        'TransformationParameter': {name: _NO_AUGMENTATION for name in (
            'add_noise', 'noise_ratio', 'scale_factors', 'crop_width', 'crop_height')},
        'DataParameter': {'task_class_num': 'not implemented: remove it'},
        'ImageDataParameter': {'task_class_num': 'not implemented: remove it',
                               'regression': 'not implemented: remove it'},
        'MemoryDataParameter': {'label_size': 'not implemented: feed the labels through an '
                                              'Input layer'},
    },
}
FORK_SETTINGS = {'%s.%s' % (message, name): (fork, instead)
                 for fork, messages in _DETECTION_OCR_SETTINGS.items()
                 for message, names in messages.items()
                 for name, instead in names.items()}
FORK_REPEATED_SETTINGS = {
    'TransformationParameter.resize_param': (
        MOBILENET_YOLO, 'its resizing to one of several sizes is not implemented: keep one '
        'resize_param; ' + _TRAIN_IN_THE_FORK),
}

#: how close (difflib ratio) a known name must be to be offered as a correction
SUGGESTION_CUTOFF = 0.8


def close_names(name, known, count=3):
    """Known names that ``name`` is probably a misspelling of (none when none is close);
    case is ignored, so 'Relu' finds 'ReLU'."""
    by_lower = {}
    for candidate in known:
        by_lower.setdefault(candidate.lower(), candidate)
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=count,
                                      cutoff=SUGGESTION_CUTOFF)
    return [by_lower[lower] for lower in close]


def fork_of_layer_type(type_name):
    """The fork that a layer type this package lacks comes from, or None."""
    return FORK_LAYER_TYPES.get(type_name)


def instead_of_layer_type(type_name):
    """What this package runs in place of a fork's layer type it lacks, or None."""
    return FORK_LAYER_INSTEAD.get(type_name)


def fork_of_param_field(field_name):
    """The fork that a LayerParameter field this package lacks comes from, or None."""
    return FORK_PARAM_FIELDS.get(field_name)


def fork_of_setting(message_name, name):
    """(fork, what this package accepts instead) for the field ``name`` that message
    ``message_name`` of the schema lacks, or None."""
    return FORK_SETTINGS.get('%s.%s' % (message_name, name))


def fork_of_repeated_setting(message_name, name):
    """(fork, what this package accepts instead) for a field ``name`` of ``message_name``
    that a fork repeats and the schema has once, or None."""
    return FORK_REPEATED_SETTINGS.get('%s.%s' % (message_name, name))
