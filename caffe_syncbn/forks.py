"""Layer types and layer settings of well-known Caffe forks that this package does not
implement, so that a net using one is told where the layer comes from instead of
being offered the nearest name of another layer.

``FORK_LAYER_TYPES`` maps a layer type to the fork it comes from, ``FORK_PARAM_FIELDS``
a LayerParameter field (``*_param``, as a prototxt spells it) to its fork. A type
or field that gets implemented is removed here (the tests check both ways).
"""
import difflib

YOLO = 'the YOLO ports of Caffe'
RFCN = "R-FCN's Caffe"
SEGNET = "SegNet's Caffe"
SSD = "Wei Liu's SSD fork of Caffe"

FORK_LAYER_TYPES = {
    'Reorg': YOLO,
    'Region': YOLO,
    'RegionLoss': YOLO,
    'PSROIPooling': RFCN,
    'DenseImageData': SEGNET,
    'VideoData': SSD,
}

FORK_PARAM_FIELDS = {
    'reorg_param': YOLO,
    'region_param': YOLO,
    'region_loss_param': YOLO,
    'dense_image_data_param': SEGNET,
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


def fork_of_param_field(field_name):
    """The fork that a LayerParameter field this package lacks comes from, or None."""
    return FORK_PARAM_FIELDS.get(field_name)
