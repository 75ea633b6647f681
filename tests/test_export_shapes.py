"""Exports never guess a shape (data/top_shapes.py, convert/inputs.py).

A data layer's tops take the shapes the layer itself gives them when it reads its source:
each reader here is checked against the real layer built on the same files. Where the
source cannot be read, to-deploy, fold-bn, to-onnx and time stop with one line asking for
--input-shape; weights for other inputs are refused by fold-bn and to-onnx in a line that
names the layer, the blob and both shapes.
"""
import logging
import sys

import numpy as np
import pytest
from helpers import watchdog
from helpers.data_sources import write_image, write_lmdb_of
from google.protobuf import text_format

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.cli import main
from caffe_syncbn.analysis.timing import timing_net_param
from caffe_syncbn.convert import fold_bn, to_deploy
from caffe_syncbn.data.top_shapes import data_top_shapes
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.export import to_onnx

from helpers.paths import ROOT

TOOL = ROOT / 'tools' / 'convert_model.py'

# the net of the report: CIFAR-sized records, scaled by 1/256 as LeNet's are
TRAIN_VAL = '''name: "tiny"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
  transform_param { scale: 0.00390625 } data_param { source: "train_lmdb" batch_size: 8
  backend: LMDB } }
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TEST }
  transform_param { scale: 0.00390625 } data_param { source: "test_lmdb" batch_size: 4
  backend: LMDB } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool1" top: "ip"
  inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc"
  include { phase: TEST } }
'''


def parse(text):
    return text_format.Parse(text, caffe_pb2.NetParameter())


def first_layer(text):
    return parse(text).layer[0]


def input_shapes(param):
    return {top: tuple(shape.dim) for layer in param.layer if layer.type == 'Input'
            for top, shape in zip(layer.top, layer.input_param.shape)}


def the_layers_own_shapes(text):
    """The tops' shapes that the real data layer gives them, reading its source."""
    net = caffe.Net(parse(text), caffe.TEST)
    return [net.blobs[top].shape for top in net.net_param.layer[0].top]


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """The report's train_val in tmp_path, both LMDBs of 3x32x32 records, and weights."""
    monkeypatch.chdir(tmp_path)
    write_lmdb_of('train_lmdb', (3, 32, 32))
    write_lmdb_of('test_lmdb', (3, 32, 32), seed=1)
    (tmp_path / 'tv.prototxt').write_text(TRAIN_VAL)
    net = caffe.Net('tv.prototxt', caffe.TEST)
    rs = np.random.RandomState(0)
    for blobs in net.params.values():
        for blob in blobs:
            blob.data[...] = rs.uniform(0.5, 1.5, blob.data.shape)
    net.save('tv.caffemodel')
    return tmp_path


# ---- each data layer type, as the layer itself reads it ------------------------------------
def test_to_deploy_reads_the_first_record_and_says_so(tiny, caplog):
    """The report: 3x32x32 records scaled by 1/256 were taken for MNIST (8,1,28,28)."""
    with caplog.at_level(logging.INFO, logger='caffe_syncbn'):
        deploy, _ = to_deploy('tv.prototxt')
    assert input_shapes(deploy) == {'data': (4, 3, 32, 32)}
    assert "layer 'data' (Data), as its source gives them: data 4x3x32x32, label 4" in caplog.text


@pytest.mark.parametrize('transform, encode, expected', [
    ('', None, (2, 1, 20, 24)),
    ('', 'png', (2, 1, 20, 24)),                             # decoded as stored: gray
    ('transform_param { force_color: true }', 'png', (2, 3, 20, 24)),
    ('transform_param { crop_size: 16 }', None, (2, 1, 16, 16)),
    ('transform_param { crop_size: 16 }', 'png', (2, 1, 16, 16)),
])
def test_lmdb_records_raw_and_encoded(tmp_path, monkeypatch, transform, encode, expected):
    monkeypatch.chdir(tmp_path)
    write_lmdb_of('db', (1, 20, 24), encode=encode)
    text = ('layer { name: "d" type: "Data" top: "x" top: "y" %s '
            'data_param { source: "db" batch_size: 2 backend: LMDB } }' % transform)
    assert data_top_shapes(first_layer(text)) == [expected, (2,)]
    assert the_layers_own_shapes(text) == [expected, (2,)]


@pytest.mark.parametrize('params, expected', [
    ('batch_size: 3', (3, 3, 30, 40)),
    ('batch_size: 3 is_color: false', (3, 1, 30, 40)),
    ('batch_size: 3 new_height: 12 new_width: 14', (3, 3, 12, 14)),
])
def test_image_data_reads_its_first_image(tmp_path, monkeypatch, params, expected):
    monkeypatch.chdir(tmp_path)
    write_image('images/a.png', 30, 40)
    (tmp_path / 'list.txt').write_text('a.png 0\n')
    text = ('layer { name: "d" type: "ImageData" top: "x" top: "y" image_data_param { '
            'source: "list.txt" root_folder: "images/" %s } }' % params)
    assert data_top_shapes(first_layer(text)) == [expected, (3,)]
    assert the_layers_own_shapes(text) == [expected, (3,)]


def test_image_data_of_a_given_size_opens_no_image(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    layer = first_layer('layer { name: "d" type: "ImageData" top: "x" image_data_param { '
                        'source: "absent.txt" new_height: 12 new_width: 14 is_color: false } '
                        'transform_param { crop_size: 10 } }')
    assert data_top_shapes(layer) == [(1, 1, 10, 10)]


def test_hdf5_data_reads_the_datasets_of_its_first_file(tmp_path, monkeypatch):
    import h5py
    monkeypatch.chdir(tmp_path)
    with h5py.File('part.h5', 'w') as f:
        f['feat'] = np.zeros((7, 5, 3), np.float32)
        f['target'] = np.zeros((7, 2), np.float32)
    (tmp_path / 'list.txt').write_text('part.h5\n')
    text = ('layer { name: "d" type: "HDF5Data" top: "feat" top: "target" '
            'hdf5_data_param { source: "list.txt" batch_size: 6 } }')
    assert data_top_shapes(first_layer(text)) == [(6, 5, 3), (6, 2)]
    assert the_layers_own_shapes(text) == [(6, 5, 3), (6, 2)]


@pytest.mark.parametrize('kind, crop, expected', [
    ('SegData', '', (1, 3, 64, 96)),                 # trimmed to its stride, 32
    ('ImageSegData', 'crop_size: 50', (2, 3, 50, 50)),
])
def test_segmentation_data_reads_its_first_image(tmp_path, monkeypatch, kind, crop, expected):
    monkeypatch.chdir(tmp_path)
    write_image('voc/a.png', 70, 100)
    write_image('voc/a_labels.png', 70, 100, channels=1)
    (tmp_path / 'pairs.txt').write_text('a.png a_labels.png\n')
    params = ('seg_data_param { source: "pairs.txt" root_dir: "voc/" }' if kind == 'SegData' else
              'image_data_param { source: "pairs.txt" root_folder: "voc/" batch_size: 2 }')
    text = ('layer { name: "d" type: "%s" top: "x" top: "y" top: "dim" %s '
            'transform_param { stride: 32 %s } }' % (kind, params, crop))
    n, _, h, w = expected
    tops = [expected, (n, 1, h, w), (n, 1, 1, 2)]
    assert data_top_shapes(first_layer(text)) == tops
    assert the_layers_own_shapes(text) == tops


def test_layers_shaped_by_their_params():
    memory = first_layer('layer { name: "m" type: "MemoryData" top: "x" top: "y" '
                         'memory_data_param { batch_size: 5 channels: 2 height: 6 width: 7 } }')
    assert data_top_shapes(memory) == [(5, 2, 6, 7), (5,)]
    window = first_layer('layer { name: "w" type: "WindowData" top: "x" top: "y" '
                         'window_data_param { source: "absent" batch_size: 4 } '
                         'transform_param { crop_size: 9 } }')
    assert data_top_shapes(window) == [(4, 3, 9, 9), (4,)]          # Caffe's: colour crops
    assert data_top_shapes(memory, batch=2, first=(3, 1, 4, 4)) == [(3, 1, 4, 4), (3,)]


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize('text, names', [
    ('layer { name: "d" type: "Data" top: "x" top: "y" '
     'data_param { source: "absent_lmdb" batch_size: 2 backend: LMDB } }', "'absent_lmdb'"),
    ('layer { name: "d" type: "Data" top: "x" data_param { source: "db" batch_size: 2 } }',
     'backend LEVELDB'),
    ('layer { name: "d" type: "ImageData" top: "x" image_data_param { source: "absent.txt" } }',
     "'absent.txt'"),
    ('layer { name: "d" type: "HDF5Data" top: "x" hdf5_data_param { source: "absent.txt" '
     'batch_size: 2 } }', "'absent.txt'"),
    ('layer { name: "d" type: "SegData" top: "x" top: "y" seg_data_param { source: "a.txt" } }',
     "'a.txt'"),
    ('layer { name: "d" type: "WindowData" top: "x" window_data_param { batch_size: 2 } }',
     'crop_size'),
    ('layer { name: "d" type: "Python" top: "x" python_param { module: "m" layer: "L" } }',
     'its own code'),
])
def test_an_unreadable_source_is_one_line_asking_for_the_shape(tmp_path, monkeypatch,
                                                               text, names):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CaffeError) as caught:
        data_top_shapes(first_layer(text))
    message = str(caught.value)
    assert message.startswith("layer 'd' (type ") and names in message
    assert message.endswith('--input-shape N,C,H,W') and '\n' not in message


def test_to_deploy_without_its_data_stops_and_writes_nothing(tiny):
    (tiny / 'test_lmdb' / 'data.mdb').unlink()
    done = watchdog.run([sys.executable, str(TOOL), 'to-deploy', '--model', 'tv.prototxt',
                         '--output', 'dep'], capture_output=True, text=True, cwd=tiny)
    assert done.returncode == 1 and done.stderr.count('\n') == 1, done.stderr
    assert "layer 'data' (type Data)" in done.stderr and "'test_lmdb'" in done.stderr
    assert '--input-shape N,C,H,W' in done.stderr
    assert not list(tiny.glob('dep*'))
    deploy, _ = to_deploy('tv.prototxt', input_shape=(2, 3, 32, 32))
    assert input_shapes(deploy) == {'data': (2, 3, 32, 32)}


# ---- weights for other inputs --------------------------------------------------------------
def test_fold_bn_refuses_weights_trained_on_other_inputs(tiny):
    """The report's chain: a deploy net at 8x1x28x28 and weights of a 3-channel net."""
    wrong, weights = to_deploy('tv.prototxt', 'tv.caffemodel', input_shape=(8, 1, 28, 28))
    with pytest.raises(CaffeError) as caught:
        fold_bn(wrong, weights)
    message = str(caught.value)
    assert message.startswith("fold_bn: <weights>: layer 'conv1' blob 0 has shape [16, 3, 3, 3] "
                              'in the weights but [16, 1, 3, 3] in the net')
    assert "input 'data' of shape 8x1x28x28" in message and '--input-shape' in message
    assert 'rename' not in message
    folded, folded_weights = fold_bn(wrong, weights, input_shape=(2, 3, 32, 32))
    assert input_shapes(folded) == {'data': (2, 3, 32, 32)}
    deploy, _ = to_deploy('tv.prototxt')
    x = np.random.RandomState(0).rand(4, 3, 32, 32)
    expected = caffe.Net(deploy, caffe.TEST, weights='tv.caffemodel').forward(data=x)['prob']
    folded.layer[0].input_param.shape[0].dim[0] = 4
    got = caffe.Net(folded, caffe.TEST, weights=folded_weights).forward(data=x)['prob']
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_fold_bn_of_a_train_val_checks_at_its_datas_shape(tiny):
    folded, _ = fold_bn('tv.prototxt', 'tv.caffemodel')
    assert [layer.type for layer in folded.layer][:2] == ['Data', 'Convolution']
    (tiny / 'test_lmdb' / 'data.mdb').unlink()
    with pytest.raises(CaffeError, match="layer 'data' .*'test_lmdb'.*--input-shape"):
        fold_bn('tv.prototxt', 'tv.caffemodel')


def test_to_onnx_names_the_input_not_a_rename(tiny):
    wrong, weights = to_deploy('tv.prototxt', 'tv.caffemodel', input_shape=(8, 1, 28, 28))
    with pytest.raises(CaffeError) as caught:
        to_onnx(wrong, weights)
    message = str(caught.value)
    assert "to_onnx: <weights>: layer 'conv1' blob 0" in message
    assert "the net's input 'data' of shape 8x1x28x28" in message and '--input-shape' in message
    assert 'rename' not in message
    to_onnx(wrong, weights, input_shapes={'data': (8, 3, 32, 32)})


def test_a_mismatch_past_the_first_layer_names_every_input(tiny):
    """pool1 -> ip reads 16x13x13 values where the weights take 16x15x15: the input's H, W."""
    text = TRAIN_VAL.replace('convolution_param { num_output: 16 kernel_size: 3 }',
                             'convolution_param { num_output: 16 kernel_size: 3 pad: 1 }')
    wrong, weights = to_deploy(parse(text), 'tv.caffemodel', input_shape=(4, 3, 28, 28))
    wrong.layer[1].convolution_param.pad[0] = 0
    with pytest.raises(CaffeError, match=r"layer 'ip' blob 0 has shape \[10, 3600\] in the "
                                         r"weights but \[10, 2704\] in the net: the weights are "
                                         r"for another net, or were trained on inputs other than "
                                         r"the net's \('data' 4x3x28x28; give"):
        fold_bn(wrong, weights)


# ---- time ---------------------------------------------------------------------------------------
def test_time_reads_the_data_of_its_phase_only(tiny, capfd):
    (tiny / 'test_lmdb' / 'data.mdb').unlink()
    assert input_shapes(timing_net_param('tv.prototxt')) == {'data': (8, 3, 32, 32),
                                                             'label': (8,)}
    assert input_shapes(timing_net_param('tv.prototxt', batch=2)) == {'data': (2, 3, 32, 32),
                                                                      'label': (2,)}
    with pytest.raises(CaffeError, match="'test_lmdb'.*--input-shape"):
        timing_net_param('tv.prototxt', phase=caffe.TEST)
    shaped = timing_net_param('tv.prototxt', phase=caffe.TEST, input_shape=(3, 3, 32, 32))
    assert input_shapes(shaped) == {'data': (3, 3, 32, 32), 'label': (3,)}
    assert main(['time', '-model', 'tv.prototxt', '-iterations', '1']) == 0
    assert 'data 8x3x32x32, label 8' in capfd.readouterr().err
    assert main(['time', '-model', 'tv.prototxt', '-iterations', '1', '-phase', 'TEST',
                 '-input_shape', '2,3,32,32']) == 0
