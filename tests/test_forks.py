"""Layers and settings of other Caffe forks: the SSD fork's now load; the ones that are
not implemented say which fork they come from (one error line), and misspellings are
corrected only when the name is really close."""
import pathlib

import pytest

from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.forks import (CAFFE_OCR, FORK_LAYER_INSTEAD, FORK_LAYER_TYPES,
                                FORK_PARAM_FIELDS, FORK_REPEATED_SETTINGS, FORK_SETTINGS,
                                MOBILENET_YOLO, YOLO)
from caffe_syncbn.layer import layer_class, layer_type_list
from caffe_syncbn.netparam.prototxt import parse_text
from test_cli import one_error_line, run_cli

SSD_GOLDEN = pathlib.Path(__file__).parent / 'ssd_golden'


def test_the_table_lists_only_what_is_missing():
    assert not set(FORK_LAYER_TYPES) & set(layer_type_list())
    fields = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    assert not set(FORK_PARAM_FIELDS) & set(fields)


def test_the_settings_tables_name_only_what_the_schema_lacks():
    for key in FORK_SETTINGS:
        path, name = key.rsplit('.', 1)
        owner = caffe_pb2
        for part in path.split('.'):
            owner = getattr(owner, part)
        if hasattr(owner, 'DESCRIPTOR') and hasattr(owner.DESCRIPTOR, 'fields_by_name'):
            assert name not in owner.DESCRIPTOR.fields_by_name, key
        else:                                       # an enum: its value names
            assert name not in owner.keys(), key
    for key in FORK_REPEATED_SETTINGS:
        message, name = key.split('.')
        assert not getattr(caffe_pb2, message).DESCRIPTOR.fields_by_name[name].is_repeated, key


@pytest.mark.parametrize('text, hint', [
    ('default_forward_type: FLOAT16\n',
     '(a setting of NVCaffe (NVIDIA/caffe); its per-layer float types are not implemented: '
     'remove it (-precision float16 or bfloat16 trains the whole net in mixed precision))'),
    ('layer { name: "c" convolution_param { cudnn_convolution_algo_seeker: FINDEX } }\n',
     '(a setting of NVCaffe (NVIDIA/caffe); a setting of its GPU code with nothing to tune '
     'here: remove it)'),
    ('layer { name: "l" loss_param { normalization: PRE_FIXED pre_fixed_normalizer: 256 } }\n',
     "(a setting of R-FCN's Caffe; not implemented: normalization FULL, VALID, BATCH_SIZE or "
     'NONE)'),
    ('layer { name: "c" convolution_param { tf_pad: SAME } }\n',
     "(a setting of chuanqi305's SSD fork (MobileNetV2-SSDLite); TensorFlow's SAME padding is "
     'not implemented: give pad, or pad_h and pad_w (Caffe pads both sides alike))'),
])
def test_a_forks_setting_names_its_fork_and_what_is_accepted(text, hint):
    with pytest.raises(CaffeError) as info:
        parse_text(text, caffe_pb2.NetParameter(), 'fork.prototxt')
    assert '\n' not in str(info.value)
    assert str(info.value).startswith('fork.prototxt:1:')
    assert str(info.value).endswith(hint)


def test_a_forks_solver_setting_names_its_fork():
    with pytest.raises(CaffeError) as info:
        parse_text('base_lr: 0.1\nlarc: true\n', caffe_pb2.SolverParameter(), 'solver.prototxt')
    assert str(info.value) == (
        'solver.prototxt:2:1: cannot parse SolverParameter: Message type '
        '"caffe.SolverParameter" has no field named "larc". (a setting of NVCaffe '
        '(NVIDIA/caffe); its solver setting is not implemented: remove it)')


@pytest.mark.parametrize('type_name', sorted(
    name for name, fork in FORK_LAYER_TYPES.items() if fork in (YOLO, MOBILENET_YOLO, CAFFE_OCR)))
def test_detection_and_ocr_forks_layer_types_say_what_runs_instead(type_name):
    with pytest.raises(CaffeError) as info:
        layer_class(type_name)
    assert str(info.value) == "layer type '%s' is from %s and is not implemented; %s" % (
        type_name, FORK_LAYER_TYPES[type_name], FORK_LAYER_INSTEAD[type_name])


#: lines of the forks' released nets (MobileNet-YOLO's training and test nets, caffe_ocr's
#: DenseNet and its data settings) and the hint each error line ends with
TRAIN_IN_FORK = 'train the net in its fork; its test and deploy nets run here)'
YOLO_DATA = ("(a setting of eric612's MobileNet-YOLO; its YOLO data and segmentation labels are "
             'not implemented: remove it (AnnotatedData samples and distorts as the SSD fork))')


@pytest.mark.parametrize('text, hint', [
    ('layer { name: "data" transform_param {\n resize_param { height: 416 }\n'
     ' resize_param { height: 320 } } }\n',
     "(a setting of eric612's MobileNet-YOLO; its resizing to one of several sizes is not "
     'implemented: keep one resize_param; ' + TRAIN_IN_FORK),
    ('layer { name: "data" annotated_data_param { yolo_data_type: 1 } }\n', YOLO_DATA),
    ('layer { name: "data" annotated_data_param { single_class: true } }\n', YOLO_DATA),
    ('layer { name: "data" transform_param { max_rotation_angle: 5 } }\n',
     "(a setting of eric612's MobileNet-YOLO; its data augmentation is not implemented: "
     'remove it)'),
    ('layer { name: "loss" type: "Yolov3" yolov3_param { side: 13 } }\n',
     "(a setting of eric612's MobileNet-YOLO; a training loss: train the net in its fork; its "
     'deploy net, which ends in YoloDetectionOutput or Yolov3DetectionOutput, runs here)'),
    ('layer { name: "loss" type: "YoloSeg" yolo_seg_param { } }\n',
     "(a setting of eric612's MobileNet-YOLO; the loss of its segmentation head: "
     + TRAIN_IN_FORK),
    ('layer { name: "loss" type: "RegionLoss" region_loss_param { side: 13 } }\n',
     '(a setting of the YOLO ports of Caffe; a training loss: train the net in its fork; its '
     'deploy net, which ends in YoloDetectionOutput or Yolov3DetectionOutput, runs here)'),
    ('layer { name: "db" type: "DenseBlock" denseblock_param { numTransition: 8 } }\n',
     "(a setting of senlinuc's caffe_ocr; write its transitions out as BatchNorm, Scale, "
     "ReLU, Convolution and Concat layers (caffe_ocr's ResNet and Inception-BN nets run "
     'here))'),
    ('layer { name: "r" type: "ReverseTime" reverse_time_param { } }\n',
     "(a setting of senlinuc's caffe_ocr; Reverse with axis 0 reverses the whole time axis, "
     'the same where every sequence fills it)'),
    ('layer { name: "data" transform_param { add_noise: true } }\n',
     "(a setting of senlinuc's caffe_ocr; its data augmentation is not implemented: remove "
     'it)'),
    ('layer { name: "data" image_data_param { task_class_num: 10 } }\n',
     "(a setting of senlinuc's caffe_ocr; not implemented: remove it)"),
])
def test_detection_and_ocr_forks_settings_name_the_fork_and_what_is_accepted(text, hint):
    with pytest.raises(CaffeError) as info:
        parse_text(text, caffe_pb2.NetParameter(), 'fork.prototxt')
    assert '\n' not in str(info.value)
    assert str(info.value).startswith('fork.prototxt:')
    assert str(info.value).endswith(hint)


def test_ssd_fork_fields_have_the_fork_numbers():
    fields = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    numbers = {name: fields[name].number for name in (
        'annotated_data_param', 'multibox_loss_param', 'permute_param', 'prior_box_param',
        'detection_output_param', 'detection_evaluate_param', 'norm_param',
        'video_data_param')}
    assert numbers == {'annotated_data_param': 200, 'multibox_loss_param': 201,
                       'permute_param': 202, 'prior_box_param': 203,
                       'detection_output_param': 204, 'detection_evaluate_param': 205,
                       'norm_param': 206, 'video_data_param': 207}
    every = [f.number for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields]
    assert len(every) == len(set(every))


def test_fork_layer_type_names_its_fork():
    with pytest.raises(CaffeError) as info:
        layer_class('VideoData')
    assert str(info.value) == \
        "layer type 'VideoData' is from Wei Liu's SSD fork of Caffe and is not implemented"


@pytest.mark.parametrize('type_name, line', [
    ('RegionLoss', "layer type 'RegionLoss' is from the YOLO ports of Caffe and is not "
                   "implemented; a training loss: train the net in its fork; its deploy net, "
                   "which ends in YoloDetectionOutput or Yolov3DetectionOutput, runs here"),
    ('DenseBlock', "layer type 'DenseBlock' is from senlinuc's caffe_ocr and is not "
                   "implemented; write its transitions out as BatchNorm, Scale, ReLU, "
                   "Convolution and Concat layers (caffe_ocr's ResNet and Inception-BN nets "
                   "run here)"),
])
def test_fork_layer_type_says_what_runs_instead(type_name, line):
    with pytest.raises(CaffeError) as info:
        layer_class(type_name)
    assert str(info.value) == line


@pytest.mark.parametrize('type_name, hint', [
    ('Convolutoin', "; did you mean 'Convolution', 'Deconvolution'?"),
    ('Relu', "; did you mean 'ReLU', 'ReLU6', 'PReLU'?"),   # case is ignored
    ('Permut', "; did you mean 'Permute'?"),
    ('Conv', ''),              # too far from 'Convolution' to guess
    ('Mish', ''),
])
def test_unknown_type_suggests_only_close_names(type_name, hint):
    with pytest.raises(CaffeError) as info:
        layer_class(type_name)
    assert str(info.value) == ("unknown layer type '%s'%s (known types: see layer_type_list())"
                               % (type_name, hint))


def test_relu6_is_a_layer_type_not_a_misspelling_of_relu():
    """MobileNetV2-SSDLite's ReLU6 once got "did you mean 'ReLU', 'PReLU'?"."""
    assert layer_class('ReLU6').__name__ == 'ReLU6Layer'


def test_fork_param_field_names_its_fork():
    text = ('layer {\n  name: "ohem"\n  type: "BoxAnnotatorOHEM"\n'
            '  box_annotator_ohem_param { roi_per_img: 128 }\n}\n')
    with pytest.raises(CaffeError) as info:
        parse_text(text, caffe_pb2.NetParameter(), 'rfcn.prototxt')
    assert str(info.value).startswith('rfcn.prototxt:4:3: cannot parse NetParameter:')
    assert str(info.value).endswith(
        '"box_annotator_ohem_param". (a layer setting of R-FCN\'s Caffe, not implemented)')
    with pytest.raises(CaffeError) as info:
        parse_text(text.replace('box_annotator_ohem_param', 'made_up_param'),
                   caffe_pb2.NetParameter())
    assert str(info.value).endswith('has no field named "made_up_param".')


def test_ssd_fork_prototxt_parses_and_times():
    """The issue's command: `time -model` of a MobileNet-SSD-style deploy prototxt."""
    result = run_cli('time', '-model', SSD_GOLDEN / 'mini_ssd_deploy.prototxt',
                     '-iterations', 1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'detection_out\tforward' in result.stderr


def test_fork_layer_in_a_net_is_one_error_line(tmp_path):
    net = tmp_path / 'yolo.prototxt'
    net.write_text('layer { name: "data" type: "Input" top: "data" input_param { shape { '
                   'dim: 1 dim: 4 dim: 4 dim: 4 } } }\n'
                   'layer { name: "loss" type: "RegionLoss" bottom: "data" top: "out" }\n')
    line = one_error_line(run_cli('time', '-model', net, '-iterations', 1))
    assert "layer 'loss': layer type 'RegionLoss' is from the YOLO ports of Caffe and is not " \
           "implemented; a training loss" in line


SSD_TRAIN_DATA = '''
layer {
  name: "data" type: "AnnotatedData" top: "data" top: "label"
  transform_param {
    mirror: true mean_value: 127.5
    resize_param { prob: 1 resize_mode: WARP height: 300 width: 300 interp_mode: LINEAR }
    emit_constraint { emit_type: CENTER }
    distort_param { brightness_prob: 0.5 brightness_delta: 32 }
    expand_param { prob: 0.5 max_expand_ratio: 4 }
  }
  data_param { source: "trainval_lmdb" batch_size: 2 backend: LMDB }
  annotated_data_param {
    batch_sampler { sampler { min_scale: 0.3 max_scale: 1 }
                    sample_constraint { min_jaccard_overlap: 0.5 } max_sample: 1 max_trials: 50 }
    label_map_file: "labelmap_voc.prototxt"
  }
}
'''


def test_ssd_fork_training_data_layer_parses_and_names_its_missing_lmdb(tmp_path):
    net = tmp_path / 'train.prototxt'
    net.write_text(SSD_TRAIN_DATA)
    param = parse_text(SSD_TRAIN_DATA, caffe_pb2.NetParameter())
    transform = param.layer[0].transform_param
    assert transform.resize_param.height == 300 and transform.expand_param.max_expand_ratio == 4
    assert param.layer[0].annotated_data_param.batch_sampler[0].max_trials == 50
    line = one_error_line(run_cli('time', '-model', net, '-phase', 'TRAIN', '-iterations', 1))
    assert "layer 'data' (type AnnotatedData): LMDB (data_param.source) 'trainval_lmdb' " \
           "not found" in line


@pytest.mark.parametrize('text, fork', [
    ('layer { name: "c" type: "DenseCRF" bottom: "a" top: "b" }',
     "layer type 'DenseCRF' is from DeepLab's Caffe (deeplab-public-ver2; write the scores with "
     "MatWrite and run DeepLab's densecrf tool on them) and is not implemented"),
    ('layer { name: "c" type: "DomainTransform" bottom: "a" top: "b" }',
     "layer type 'DomainTransform' is from DeepLab's Caffe (deeplab-public-ver2) and is not "
     'implemented'),
])
def test_deeplabs_missing_layers_name_deeplab(text, fork):
    net = parse_text(text, caffe_pb2.NetParameter())
    with pytest.raises(CaffeError) as info:
        layer_class(net.layer[0].type, net.layer[0])
    assert fork in str(info.value)


def test_deeplabs_crf_settings_name_deeplab():
    text = 'layer { name: "crf" type: "DenseCRF" dense_crf_param { max_iter: 10 } }'
    with pytest.raises(CaffeError) as info:
        parse_text(text, caffe_pb2.NetParameter(), 'test.prototxt')
    assert str(info.value).endswith(
        '"dense_crf_param". (a layer setting of DeepLab\'s Caffe (deeplab-public-ver2; write the '
        "scores with MatWrite and run DeepLab's densecrf tool on them), not implemented)")


def test_deeplabs_batchnorm_setting_names_deeplab():
    text = ('layer { name: "bn" type: "BatchNorm" batch_norm_param { use_global_stats: true '
            'update_global_stats: true } }')
    with pytest.raises(CaffeError) as info:
        parse_text(text, caffe_pb2.NetParameter(), 'test.prototxt')
    assert str(info.value).endswith(
        "\"update_global_stats\". (a layer setting of DeepLab's Caffe (deeplab-public-ver2), not "
        'implemented)')


@pytest.mark.parametrize('text, hint', [
    # DeepLab v1's test nets (V1 format): ImageSegData's has_label, read by none of its layers
    ('layers { name: "data" type: IMAGE_SEG_DATA top: "data" image_data_param { '
     'has_label: false } }\n',
     "(a setting of DeepLab v1's Caffe (deeplab-public); read by none of its layers: remove it)"),
    ('layers { name: "conv5_1" type: CONVOLUTION convolution_param { num_output: 8 '
     'hole: 2 } }\n',
     "(a setting of DeepLab v1's Caffe (deeplab-public); the input stride of its atrous "
     'convolution: write dilation (one value, or two: height and width), as BVLC names it)'),
    ('layers { name: "fc6" type: CONVOLUTION strict_dim: false }\n',
     "(a setting of DeepLab v1's Caffe (deeplab-public); copying weights into a layer of another "
     "shape by their count is not implemented: remove it, and give the weights the layer's "
     'shape (net surgery))'),
])
def test_probed_forks_settings_name_their_fork(text, hint):
    """Settings of real nets of the held-out probe (issue #32) that stopped on a bare
    protobuf line: DeepLab v1's ImageSegData, atrous convolution and weight copying."""
    with pytest.raises(CaffeError) as info:
        parse_text(text, caffe_pb2.NetParameter(), 'probe.prototxt')
    assert '\n' not in str(info.value)
    assert str(info.value).startswith('probe.prototxt:1:')
    assert str(info.value).endswith(hint)


def test_a_templates_placeholder_says_to_fill_the_template():
    """DeepLab's configs are templates that its run script fills with sed; read as they are,
    they stopped on "Couldn't parse integer: $"."""
    text = 'name: "${NET_ID}"\nlayer {\n  name: "fc8"\n  convolution_param {\n' \
           '    num_output: ${NUM_LABELS}\n  }\n}\n'
    with pytest.raises(CaffeError) as info:
        parse_text(text, caffe_pb2.NetParameter(), 'test.prototxt')
    assert str(info.value).startswith('test.prototxt:5:')
    assert str(info.value).endswith(
        '(${NUM_LABELS} is a placeholder of a template, which its run script fills before '
        'Caffe reads it: fill it first)')
    with pytest.raises(CaffeError) as info:      # another line's mistake gets no such hint
        parse_text(text.replace('num_output: ${NUM_LABELS}', 'num_output: x'),
                   caffe_pb2.NetParameter(), 'test.prototxt')
    assert 'placeholder' not in str(info.value)


PYTHON_NET = '''
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer { name: "%s" type: "Python" bottom: "data" top: "out"
        python_param { module: "%s" layer: "%s" } }
'''


@pytest.mark.parametrize('module, layer, origin', [
    ('rpn.proposal_layer', 'ProposalLayer',
     "; it is py-faster-rcnn's lib (py-R-FCN carries the same): Python 2 code with a compiled "
     'NMS (lib/nms); put a Python 3 port of lib, its NMS built, on PYTHONPATH'),
    ('spatial_dropout', 'SpatialDropoutLayer',
     "; it is caffe-enet's python/spatial_dropout.py (Python 2 code); ENet's "
     'scripts/BN-absorber-enet.py folds these layers into the convolutions: run '
     'enet_deploy_final.prototxt with the weights it writes'),
    ('voc_layers', 'VOCSegDataLayer',
     '; it is a data layer of fcn.berkeleyvision.org (the .py file of that name there): run '
     'from that folder or put it on PYTHONPATH'),
    ('caffe.layers.detectnet.clustering', 'ClusterDetections',
     "; it is NVCaffe's DetectNet clustering, which its own pycaffe carries: DetectNet is not "
     'implemented here'),
    ('made_up_layers', 'Anything', ''),
])
def test_a_forks_python_module_that_is_missing_says_where_it_is(tmp_path, module, layer,
                                                               origin):
    """The held-out probe's py-faster-rcnn, py-R-FCN and ENet nets stopped on "No module
    named 'rpn'", which names no repository."""
    net = tmp_path / 'net.prototxt'
    net.write_text(PYTHON_NET % ('py', module, layer))
    line = one_error_line(run_cli('time', '-model', net, '-iterations', 1, cwd=tmp_path))
    assert line.endswith("layer 'py' (type Python): cannot import python_param module '%s': "
                         "No module named '%s'%s" % (module, module.split('.')[0], origin))
