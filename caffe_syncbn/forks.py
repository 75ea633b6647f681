"""Layer types and layer settings of well-known Caffe forks that this package does not
implement, so that a net using one is told where the layer comes from instead of
being offered the nearest name of another layer.

``FORK_LAYER_TYPES`` maps a layer type to the fork it comes from, ``FORK_PARAM_FIELDS``
a LayerParameter field (``*_param``, as a prototxt spells it), or a fork's field of another
message, to its fork. A type or field that gets implemented is removed here (the tests
check both ways).
"""
import difflib

YOLO = 'the YOLO ports of Caffe'
RFCN = "R-FCN's Caffe"
SSD = "Wei Liu's SSD fork of Caffe"
DEEPLAB = "DeepLab's Caffe (deeplab-public-ver2)"
#: DeepLab's own nets leave DenseCRF commented out and run the CRF as a tool afterwards
DEEPLAB_CRF = ("DeepLab's Caffe (deeplab-public-ver2; write the scores with MatWrite and run "
               "DeepLab's densecrf tool on them)")
DEEPLAB_V1 = "DeepLab v1's Caffe (deeplab-public)"

FORK_LAYER_TYPES = {
    'Reorg': YOLO,
    'Region': YOLO,
    'RegionLoss': YOLO,
    'PSROIPooling': RFCN,
    'VideoData': SSD,
    # DeepLab: ImageSegData, Interp, SegAccuracy, MatWrite and MatRead are implemented
    'DenseCRF': DEEPLAB_CRF,
    'DomainTransform': DEEPLAB,
    'DomainTransformForwardOnly': DEEPLAB,
    'BiasChannel': DEEPLAB,
    'AdaptiveBiasChannel': DEEPLAB,
    'SpatialProduct': DEEPLAB,
    'UniqueLabel': DEEPLAB,
    'Padding': DEEPLAB_V1,
    'DominantChannel': DEEPLAB_V1,
    'CensorLabel': DEEPLAB_V1,
    'ChannelAggregator': DEEPLAB_V1,
    'IgnoreOverlay': DEEPLAB_V1,
    'Histogram': DEEPLAB_V1,
    'RelativeError': DEEPLAB_V1,
    'GainChannel': DEEPLAB_V1,
    'OneHot': DEEPLAB_V1,
}

FORK_PARAM_FIELDS = {
    'reorg_param': YOLO,
    'region_param': YOLO,
    'region_loss_param': YOLO,
    'psroi_pooling_param': RFCN,
    'dense_crf_param': DEEPLAB_CRF,
    'domain_transform_param': DEEPLAB,
    'bias_channel_param': DEEPLAB,
    'adaptive_bias_channel_param': DEEPLAB,
    'unique_label_param': DEEPLAB,
    'update_global_stats': DEEPLAB,          # its BatchNorm's, unused by its released nets
    'padding_param': DEEPLAB_V1,
    'dominant_channel_param': DEEPLAB_V1,
    'censor_label_param': DEEPLAB_V1,
    'channel_aggregator_param': DEEPLAB_V1,
    'ignore_overlay_param': DEEPLAB_V1,
    'histogram_param': DEEPLAB_V1,
    'gain_channel_param': DEEPLAB_V1,
    'onehot_param': DEEPLAB_V1,
    'softmaxloss_param': DEEPLAB_V1,
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
