"""Layer types and layer settings of well-known Caffe forks that this package does not
implement, so that a net using one is told where the layer comes from instead of
being offered the nearest name of another layer.

``FORK_LAYER_TYPES`` maps a layer type to the fork it comes from, ``FORK_PARAM_FIELDS``
a LayerParameter field (``*_param``, as a prototxt spells it) to its fork, and
``FORK_LAYER_INSTEAD`` a layer type to what this package runs in its place, where there
is something. A type or field that gets implemented is removed here (the tests check
both ways).
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
    'region_loss_param': YOLO,
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
FORK_PARAM_FIELDS.update({
    'yolov3_param': MOBILENET_YOLO,
    'yolo_seg_param': MOBILENET_YOLO,
    'segmentation_evaluate_param': MOBILENET_YOLO,
    'denseblock_param': CAFFE_OCR,
    'reverse_time_param': CAFFE_OCR,
})
FORK_LAYER_INSTEAD = {
    'RegionLoss': _YOLO_LOSS,
    'Yolov3': _YOLO_LOSS,
    'GaussianYolov3': _YOLO_LOSS,
    'DenseBlock': 'write its transitions out as BatchNorm, Scale, ReLU, Convolution and '
                  'Concat layers (caffe_ocr\'s ResNet and Inception-BN nets run here)',
    'ReverseTime': 'Reverse with axis 0 reverses the whole time axis, the same where '
                   'every sequence fills it',
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
