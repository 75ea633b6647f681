"""Layers and settings of other Caffe forks: the SSD fork's now load; the ones that are
not implemented say which fork they come from (one error line), and misspellings are
corrected only when the name is really close."""
import pathlib

import pytest

from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.forks import FORK_LAYER_TYPES, FORK_PARAM_FIELDS
from caffe_syncbn.layer import layer_class, layer_type_list
from caffe_syncbn.netparam.prototxt import parse_text
from test_cli import one_error_line, run_cli

SSD_GOLDEN = pathlib.Path(__file__).parent / 'ssd_golden'


def test_the_table_lists_only_what_is_missing():
    assert not set(FORK_LAYER_TYPES) & set(layer_type_list())
    fields = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    assert not set(FORK_PARAM_FIELDS) & set(fields)


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
    ('Relu', "; did you mean 'ReLU', 'PReLU', 'ELU'?"),   # case is ignored
    ('Permut', "; did you mean 'Permute'?"),
    ('Conv', ''),              # too far from 'Convolution' to guess
    ('Mish', ''),
])
def test_unknown_type_suggests_only_close_names(type_name, hint):
    with pytest.raises(CaffeError) as info:
        layer_class(type_name)
    assert str(info.value) == ("unknown layer type '%s'%s (known types: see layer_type_list())"
                               % (type_name, hint))


def test_fork_param_field_names_its_fork():
    text = 'layer {\n  name: "yolo"\n  type: "Yolov3"\n  yolov3_param { side: 13 }\n}\n'
    with pytest.raises(CaffeError) as info:
        parse_text(text, caffe_pb2.NetParameter(), 'yolo.prototxt')
    assert str(info.value).startswith('yolo.prototxt:4:3: cannot parse NetParameter:')
    assert str(info.value).endswith(
        '"yolov3_param". (a layer setting of eric612\'s MobileNet-YOLO, not implemented)')
    with pytest.raises(CaffeError) as info:
        parse_text(text.replace('yolov3_param', 'made_up_param'), caffe_pb2.NetParameter())
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
