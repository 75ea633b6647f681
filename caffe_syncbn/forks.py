"""Layer types and layer settings of well-known Caffe forks that this package does not
implement, so that a net using one is told where the layer comes from instead of
being offered the nearest name of another layer.

``FORK_LAYER_TYPES`` maps a layer type to the fork it comes from, ``FORK_PARAM_FIELDS``
a LayerParameter field (``*_param``, as a prototxt spells it), or a fork's field of another
message, to its fork, and ``FORK_LAYER_INSTEAD`` a layer type to what this package runs in
its place, where there is something. ``FORK_SETTINGS`` maps a field or enum value inside
any message of the schema ('Message.field', 'Message.Enum.VALUE') to its fork and what
this package accepts instead, and ``FORK_REPEATED_SETTINGS`` a field that a fork repeats
where the schema has one. ``FORK_PYTHON_MODULES`` maps a Python layer's module that a
fork's repository ships to where it is and what importing it takes. A type, field or value
that gets implemented is removed here (the tests check both ways).
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
NVCAFFE = 'NVCaffe (NVIDIA/caffe)'
CHUANQI305 = "chuanqi305's SSD fork (MobileNetV2-SSDLite)"

FORK_LAYER_TYPES = {
    'RegionLoss': YOLO,
    'VideoData': SSD,
    'BoxAnnotatorOHEM': RFCN,
    'DetectNetTransformation': NVCAFFE,
    'L1Loss': NVCAFFE,
    'TRT': NVCAFFE,
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
    'box_annotator_ohem_param': RFCN,
    'detectnet_groundtruth_param': NVCAFFE,
    'detectnet_augmentation_param': NVCAFFE,
    'trt_param': NVCAFFE,
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

# ---- settings inside other messages: NVCaffe, R-FCN, chuanqi305's SSD fork ----------------
_FLOAT_TYPE = ('its per-layer float types are not implemented: remove it (-precision float16 '
               'or bfloat16 trains the whole net in mixed precision)')
_TUNING = 'a setting of its GPU code with nothing to tune here: remove it'
_AUGMENTATION = 'its data augmentation is not implemented: remove it'
_SOLVER = 'its solver setting is not implemented: remove it'
_NVCAFFE_SETTINGS = {
    'NetParameter': {name: _FLOAT_TYPE for name in (
        'default_forward_type', 'default_backward_type', 'default_forward_math',
        'default_backward_math', 'global_grad_scale', 'global_grad_scale_adaptive')},
    'LayerParameter': {name: _FLOAT_TYPE for name in (
        'forward_type', 'backward_type', 'forward_math', 'backward_math')},
    'ConvolutionParameter': {name: _TUNING for name in (
        'cudnn_convolution_algo_seeker', 'conv_algos_override')},
    'DataParameter': {name: _TUNING for name in ('threads', 'parser_threads', 'cache',
                                                 'precache')},
    'ImageDataParameter': {name: _TUNING for name in (
        'threads', 'cache', 'precache', 'dataset_share_per_node')},
    'TransformationParameter': {name: _AUGMENTATION for name in (
        'use_gpu_transform', 'img_rand_resize_lower', 'img_rand_resize_upper',
        'rand_resize_ratio_lower', 'rand_resize_ratio_upper', 'vertical_stretch_lower',
        'vertical_stretch_upper', 'horizontal_stretch_lower', 'horizontal_stretch_upper',
        'interpolation_algo_down', 'interpolation_algo_up', 'allow_upscale',
        'forward_packing', 'display', 'num_labels')},
    'SolverParameter': {name: _SOLVER for name in (
        'rampup_interval', 'rampup_lr', 'min_lr', 'solver_data_type',
        'store_blobs_in_old_format', 'momentum_policy', 'max_momentum', 'momentum_power',
        'larc', 'larc_policy', 'larc_eta', 'weight_decay_policy', 'weight_decay_power',
        'test_and_snapshot_last_epochs', 'larc_turbo', 'max_weight_decay', 'eval_type',
        'ap_version', 'plateau_winsize', 'show_per_class_result')},
}
_NVCAFFE_SETTINGS['NetParameter'].update(
    {name: _TUNING for name in ('default_conv_algos_override', 'reduce_buckets',
                                'default_cudnn_math_override', 'eltwise_mem_sharing')})
_NVCAFFE_SETTINGS['LayerParameter'].update(cudnn_math_override=_TUNING, debug=_TUNING)
_NVCAFFE_SETTINGS['DataParameter']['shuffle'] = \
    'reading LMDB records in a new order each epoch is not implemented: remove it'
_NVCAFFE_SETTINGS['ImageDataParameter']['short_side'] = \
    'not implemented: resize with new_height and new_width'
_NVCAFFE_SETTINGS['TransformationParameter']['random_seed'] = _AUGMENTATION
_NVCAFFE_SETTINGS['DropoutParameter'] = {'engine': _TUNING,
                                         'random_seed': 'not implemented: remove it'}
_NVCAFFE_SETTINGS['ELUParameter'] = {
    'lambda': 'not implemented: scale the ELU by a Power layer (power_param { scale })'}
_NVCAFFE_SETTINGS['LossParameter'] = {'label_smoothing': 'not implemented: remove it'}

FORK_SETTINGS = {'%s.%s' % (message, name): (NVCAFFE, instead)
                 for message, names in _NVCAFFE_SETTINGS.items()
                 for name, instead in names.items()}
FORK_SETTINGS.update({
    'LossParameter.pre_fixed_normalizer': (
        RFCN, 'not implemented: normalization FULL, VALID, BATCH_SIZE or NONE'),
    'LossParameter.NormalizationMode.PRE_FIXED': (
        RFCN, 'not implemented: normalization FULL, VALID, BATCH_SIZE or NONE'),
    'ConvolutionParameter.tf_pad': (
        CHUANQI305, "TensorFlow's SAME padding is not implemented: give pad, or pad_h and "
        'pad_w (Caffe pads both sides alike)'),
    'PriorBoxParameter.reduce_boxes': (CHUANQI305, 'not implemented: remove it'),
})

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
_DETECTION_OCR_SETTINGS = {
    YOLO: {'LayerParameter': {'region_loss_param': _YOLO_LOSS}},
    MOBILENET_YOLO: {
        'LayerParameter': {'yolov3_param': _YOLO_LOSS,
                           'yolo_seg_param': FORK_LAYER_INSTEAD['YoloSeg'],
                           'segmentation_evaluate_param':
                               FORK_LAYER_INSTEAD['SegmentationEvaluate']},
        'TransformationParameter': {name: _AUGMENTATION for name in (
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
        'TransformationParameter': {name: _AUGMENTATION for name in (
            'add_noise', 'noise_ratio')},
        'DataParameter': {'task_class_num': 'not implemented: remove it'},
        'ImageDataParameter': {'task_class_num': 'not implemented: remove it',
                               'regression': 'not implemented: remove it'},
        'MemoryDataParameter': {'label_size': 'not implemented: feed the labels through an '
                                              'Input layer'},
    },
}
FORK_SETTINGS.update({'%s.%s' % (message, name): (fork, instead)
                      for fork, messages in _DETECTION_OCR_SETTINGS.items()
                      for message, names in messages.items()
                      for name, instead in names.items()})
FORK_REPEATED_SETTINGS = {
    'TransformationParameter.resize_param': (
        MOBILENET_YOLO, 'its resizing to one of several sizes is not implemented: keep one '
        'resize_param; ' + _TRAIN_IN_THE_FORK),
}

# ---- DeepLab v1's settings that BVLC's schema names otherwise or not at all ----------------
#: its hole, hole_h and hole_w sit at the numbers of BVLC's force_nd_im2col and dilation
_HOLE = 'the input stride of its atrous convolution: write dilation (one value, or two: ' \
        'height and width), as BVLC names it'
#: declared in its schema, read by none of its layers (ImageSegData reads label_type)
_UNREAD = 'read by none of its layers: remove it'
FORK_SETTINGS.update({
    'ConvolutionParameter.hole': (DEEPLAB_V1, _HOLE),
    'ConvolutionParameter.hole_h': (DEEPLAB_V1, _HOLE),
    'ConvolutionParameter.hole_w': (DEEPLAB_V1, _HOLE),
    'ImageDataParameter.has_label': (DEEPLAB_V1, _UNREAD),
    'ImageDataParameter.max_labels': (DEEPLAB_V1, _UNREAD),
    'V1LayerParameter.strict_dim': (
        DEEPLAB_V1, 'copying weights into a layer of another shape by their count is not '
        "implemented: remove it, and give the weights the layer's shape (net surgery)"),
})

# ---- Python layers that the forks' repositories ship (python_param.module) --------------
_FASTER_RCNN_LIB = ("py-faster-rcnn's lib (py-R-FCN carries the same): Python 2 code with a "
                    'compiled NMS (lib/nms); put a Python 3 port of lib, its NMS built, on '
                    'PYTHONPATH')
_FCN_DATA = ('a data layer of fcn.berkeleyvision.org (the .py file of that name there): run '
             'from that folder or put it on PYTHONPATH')
FORK_PYTHON_MODULES = {
    'rpn.proposal_layer': _FASTER_RCNN_LIB,
    'rpn.anchor_target_layer': _FASTER_RCNN_LIB,
    'rpn.proposal_target_layer': _FASTER_RCNN_LIB,
    'roi_data_layer.layer': _FASTER_RCNN_LIB,
    'spatial_dropout': ("caffe-enet's python/spatial_dropout.py (Python 2 code); ENet's "
                        'scripts/BN-absorber-enet.py folds these layers into the convolutions: '
                        'run enet_deploy_final.prototxt with the weights it writes'),
    'voc_layers': _FCN_DATA,
    'siftflow_layers': _FCN_DATA,
    'nyud_layers': _FCN_DATA,
    'pascalcontext_layers': _FCN_DATA,
    # DetectNet's Python layers, part of NVCaffe's own pycaffe (python/caffe/layers/detectnet)
    'caffe.layers.detectnet.clustering': "NVCaffe's DetectNet clustering, which its own "
                                         'pycaffe carries: DetectNet is not implemented here',
    'caffe.layers.detectnet.mean_ap': "NVCaffe's DetectNet mAP, which its own pycaffe carries: "
                                      'DetectNet is not implemented here',
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
    """(fork, what this package accepts instead) for the field or enum value ``name`` that
    message (or enum) ``message_name`` of the schema lacks, or None."""
    return FORK_SETTINGS.get('%s.%s' % (message_name, name))


def fork_of_repeated_setting(message_name, name):
    """(fork, what this package accepts instead) for a field ``name`` of ``message_name``
    that a fork repeats and the schema has once, or None."""
    return FORK_REPEATED_SETTINGS.get('%s.%s' % (message_name, name))


def origin_of_python_module(module):
    """Where a Python layer's module that a fork's repository ships comes from, and what to
    do to import it, or None."""
    return FORK_PYTHON_MODULES.get(module)
