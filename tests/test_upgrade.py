"""Upgrading legacy nets (V1 layers, net-level inputs, old BatchNorm) and swapping data layers."""
import json

import h5py
import numpy as np
import pytest
from google.protobuf import text_format

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.formats.blobs import blob_to_array, write_blob_proto
from caffe_syncbn.formats.caffemodel import read_net_param
from caffe_syncbn.layer import layer_type_list
from caffe_syncbn.netparam.inputs import is_data_layer, swap_data_layers_for_inputs
from caffe_syncbn.netparam.prototxt import parse_text, read_prototxt
from caffe_syncbn.netparam.upgrade import V1_TYPE_NAMES, upgrade_net_param

from helpers.paths import CORPUS, GOLDEN, require

V1 = caffe_pb2.V1LayerParameter


def parse(text):
    return text_format.Parse(text, caffe_pb2.NetParameter())


def corpus_nets():
    if not CORPUS.is_dir():
        return ['<no corpus>']
    return sorted(p.name for p in CORPUS.glob('*.prototxt') if 'solver' not in p.name)


def corpus_net(name):
    return read_prototxt(require(CORPUS / name), caffe_pb2.NetParameter())


def input_shapes(net):
    """{top: shape} of every Input layer (the last one wins for tops in several phases)."""
    return {top: tuple(s.dim) for lp in net.layer if lp.type == 'Input'
            for top, s in zip(lp.top, lp.input_param.shape)}


# ---- V1 ---------------------------------------------------------------------------------
def test_every_v1_type_and_param_has_a_v2_home():
    assert set(V1.LayerType.keys()) == set(V1_TYPE_NAMES)
    v2_fields = set(caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name)
    v1_params = {f for f in V1.DESCRIPTOR.fields_by_name if f.endswith('_param')}
    assert v1_params <= v2_fields
    for name in v1_params:      # same message type, so CopyFrom works
        assert (V1.DESCRIPTOR.fields_by_name[name].message_type is
                caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name[name].message_type)


def test_v1_prototxt_upgrades_to_the_v2_net():
    v1 = read_prototxt(require(GOLDEN / 'format_v1_caffemodel.v1.prototxt'),
                       caffe_pb2.NetParameter())
    v2 = read_prototxt(GOLDEN / 'format_v1_caffemodel.prototxt', caffe_pb2.NetParameter())
    upgraded = upgrade_net_param(v1)
    assert len(upgraded.layers) == 0 and len(upgraded.input) == 0 and len(upgraded.input_dim) == 0
    first = upgraded.layer[0]
    assert (first.name, first.type, list(first.top)) == ('input', 'Input', ['data'])
    assert first.input_param == v2.layer[0].input_param
    assert list(upgraded.layer)[1:] == list(v2.layer)[1:]
    assert len(v1.layers) == 6          # the input is left alone


def test_v1_caffemodel_keeps_its_blobs():
    v1 = read_net_param(require(GOLDEN / 'format_v1_caffemodel.v1.caffemodel'))
    upgraded = upgrade_net_param(v1)
    ip = [lp for lp in upgraded.layer if lp.name == 'ip1'][0]
    assert ip.type == 'InnerProduct'
    assert [(p.lr_mult, p.decay_mult) for p in ip.param] == [(1, 1), (2, 0)]
    assert blob_to_array(ip.blobs[0]).shape == (1, 1, 5, 100)


def test_v1_param_specs_and_data_transform():
    net = parse('''
      layers { name: "d" type: DATA top: "x" top: "y"
               data_param { source: "s" batch_size: 4 scale: 0.5 crop_size: 7 mirror: true
                            mean_file: "m.binaryproto" } }
      layers { name: "ip" type: INNER_PRODUCT bottom: "x" top: "z" param: "w" param: "b"
               blob_share_mode: PERMISSIVE blobs_lr: 3 blobs_lr: 4 weight_decay: 0.5
               inner_product_param { num_output: 2 } include { phase: TRAIN } }
      layers { name: "loss" type: SOFTMAX_LOSS bottom: "z" bottom: "y" loss_weight: 2
               loss_param { ignore_label: 255 } }''')
    up = upgrade_net_param(net)
    data, ip, loss = up.layer
    assert data.type == 'Data'
    assert text_format.MessageToString(data.data_param, as_one_line=True) == \
        'source: "s" batch_size: 4'
    tp = data.transform_param
    assert (tp.scale, tp.crop_size, tp.mirror, tp.mean_file) == (0.5, 7, True, 'm.binaryproto')
    assert [(p.name, p.share_mode, p.lr_mult, p.decay_mult) for p in ip.param] == [
        ('w', caffe_pb2.ParamSpec.PERMISSIVE, 3, 0.5), ('b', caffe_pb2.ParamSpec.STRICT, 4, 1)]
    assert not ip.param[1].HasField('share_mode')
    assert ip.include[0].phase == caffe_pb2.TRAIN and ip.inner_product_param.num_output == 2
    assert (loss.type, list(loss.loss_weight), loss.loss_param.ignore_label) == \
        ('SoftmaxWithLoss', [2], 255)


DEEPLAB_V1 = '''
  layers { name: "data" type: IMAGE_SEG_DATA top: "data" top: "label"
           image_data_param { source: "list.txt" batch_size: 1 label_type: PIXEL }
           transform_param { crop_size: 306 mean_value: 104 } }
  layers { name: "shrink" type: INTERP bottom: "label" top: "label_shrink"
           interp_param { shrink_factor: 8 pad_beg: 0 pad_end: 0 } }
  layers { name: "accuracy" type: SEG_ACCURACY bottom: "data" bottom: "label_shrink"
           top: "accuracy" seg_accuracy_param { ignore_label: 255 } }
  layers { name: "out" type: MAT_WRITE bottom: "data"
           mat_write_param { prefix: "features/" source: "ids.txt" strip: 0 period: 1 } }'''


def test_deeplab_v1_layer_types_upgrade_with_their_settings():
    """DeepLab v1's prototxts use the V1 format with its own layer types."""
    data, shrink, accuracy, out = upgrade_net_param(parse(DEEPLAB_V1)).layer
    assert [layer.type for layer in (data, shrink, accuracy, out)] == [
        'ImageSegData', 'Interp', 'SegAccuracy', 'MatWrite']
    assert data.image_data_param.label_type == caffe_pb2.ImageDataParameter.PIXEL
    assert data.transform_param.crop_size == 306
    assert shrink.interp_param.shrink_factor == 8
    assert list(accuracy.seg_accuracy_param.ignore_label) == [255]
    assert out.mat_write_param.prefix == 'features/'
    with pytest.raises(CaffeError) as info:                 # its list is not here
        caffe.Net(upgrade_net_param(parse(DEEPLAB_V1)), caffe.TRAIN)
    assert "layer 'data' (type ImageSegData): as DeepLab's ImageSegData (deeplab-public-ver2): " \
           in str(info.value)


def test_deeplab_v1_types_this_package_lacks_name_deeplab():
    net = upgrade_net_param(parse('layers { name: "crf" type: DENSE_CRF bottom: "a" top: "b" }'))
    with pytest.raises(CaffeError) as info:
        caffe.Net(net, caffe.TEST)
    assert "layer type 'DenseCRF' is from DeepLab's Caffe (deeplab-public-ver2; write the " \
           "scores with MatWrite and run DeepLab's densecrf tool on them) and is not " \
           'implemented' in str(info.value)
    with pytest.raises(CaffeError) as info:
        parse_text('layers { name: "p" type: PADDING padding_param { pad: 1 } }',
                   caffe_pb2.NetParameter(), 'deeplab_v1.prototxt')
    assert str(info.value).endswith('"padding_param". (a layer setting of DeepLab v1\'s Caffe '
                                    '(deeplab-public), not implemented)')


def test_upgrade_refuses_v0_and_mixed_nets():
    with pytest.raises(CaffeError, match='V0 layer format'):
        upgrade_net_param(parse('layers { layer { name: "c" type: "conv" } }'))
    with pytest.raises(CaffeError, match="mixes the 'layer'"):
        upgrade_net_param(parse('layer { name: "a" type: "ReLU" } layers { name: "b" type: RELU }'))


def test_upgrade_does_not_touch_its_argument():
    net = parse('input: "x" input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4 '
                'layers { name: "r" type: RELU bottom: "x" top: "x" }')
    before = net.SerializeToString()
    upgrade_net_param(net)
    assert net.SerializeToString() == before


# ---- net-level inputs -------------------------------------------------------------------
def test_input_dim_and_input_shape():
    net = upgrade_net_param(parse('''
        name: "n" input: "a" input: "b"
        input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4
        input_dim: 5 input_dim: 6 input_dim: 7 input_dim: 8
        layer { name: "r" type: "ReLU" bottom: "a" top: "c" }'''))
    assert [lp.name for lp in net.layer] == ['input', 'r']
    assert input_shapes(net) == {'a': (1, 2, 3, 4), 'b': (5, 6, 7, 8)}
    net = upgrade_net_param(parse('input: "a" input_shape { dim: 3 dim: 10 }'))
    assert input_shapes(net) == {'a': (3, 10)}


@pytest.mark.parametrize('text, message', [
    ('input: "a" input_dim: 1 input_dim: 2', r'needs 4 input_dim values.*got 2'),
    ('input: "a" input: "b" input_shape { dim: 1 }', '2 inputs but 1 input_shape'),
    ('input_dim: 1 input_dim: 2 input_dim: 3 input_dim: 4', 'no input names'),
])
def test_bad_inputs(text, message):
    with pytest.raises(CaffeError, match=message):
        upgrade_net_param(parse(text))


def test_old_batchnorm_params_are_fixed():
    net = upgrade_net_param(parse('''
        layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x"
                param { lr_mult: 1 } param { lr_mult: 1 } param { lr_mult: 1 decay_mult: 3 } }
        layer { name: "bn2" type: "BatchNorm" bottom: "x" top: "x" param { lr_mult: 1 } }'''))
    assert [(p.lr_mult, p.decay_mult) for p in net.layer[0].param] == [(0, 0)] * 3
    assert net.layer[1].param[0].lr_mult == 1


# ---- swapping data layers ---------------------------------------------------------------
@pytest.mark.parametrize('name', corpus_nets())
def test_swap_makes_every_corpus_net_data_free(name):
    net = swap_data_layers_for_inputs(corpus_net(name))
    assert not any(is_data_layer(lp) for lp in net.layer)
    for lp in net.layer:
        if lp.type == 'Input':
            assert len(lp.input_param.shape) == len(lp.top)
            assert all(len(s.dim) and min(s.dim) > 0 for s in lp.input_param.shape)


def caffe_shapes():
    path = CORPUS / 'caffe_shapes.json'
    return json.loads(path.read_text()) if path.exists() else {}


def _build(net_param, phase, **kwargs):
    """A Net of ``net_param`` in ``phase``, or a skip when some layer type is missing."""
    from caffe_syncbn import Net
    missing = {lp.type for lp in net_param.layer} - set(layer_type_list())
    if missing:
        pytest.skip('layer types not implemented yet: %s' % sorted(missing))
    return Net(net_param, phase, **kwargs)


@pytest.mark.parametrize('name', sorted(caffe_shapes()) or ['<no corpus>'])
def test_swap_reproduces_caffe_shapes(name):
    recorded = caffe_shapes().get(name) or pytest.skip('caffe_shapes.json is absent')
    original = upgrade_net_param(corpus_net(name))
    data_tops = [top for lp in original.layer if lp.type == 'Input' for top in lp.top]
    for phase_name, phase in (('TRAIN', caffe_pb2.TRAIN), ('TEST', caffe_pb2.TEST)):
        blobs = recorded[phase_name]['blobs']
        shapes = {top: blobs[top] for top in data_tops}
        net = swap_data_layers_for_inputs(corpus_net(name), shapes=shapes)
        assert {t: list(s) for t, s in input_shapes(net).items()} == shapes
    for phase_name, phase in (('TRAIN', caffe_pb2.TRAIN), ('TEST', caffe_pb2.TEST)):
        built = _build(swap_data_layers_for_inputs(corpus_net(name)), phase)
        for blob, shape in recorded[phase_name]['blobs'].items():
            assert list(built.blobs[blob].shape) == shape, (phase_name, blob)


# train/val nets: the swap's default guesses, as BVLC Caffe would shape these datasets
DATA_NET_GUESSES = {
    'BVLC_caffe__examples_mnist_lenet_train_test.prototxt': {
        'TRAIN': {'data': (64, 1, 28, 28), 'label': (64,)},
        'TEST': {'data': (100, 1, 28, 28), 'label': (100,)}},
    'BVLC_caffe__examples_cifar10_cifar10_full_sigmoid_train_test_bn.prototxt': {
        'TRAIN': {'data': (100, 3, 32, 32), 'label': (100,)},
        'TEST': {'data': (1000, 3, 32, 32), 'label': (1000,)}},
    'BVLC_caffe__models_bvlc_alexnet_train_val.prototxt': {
        'TRAIN': {'data': (256, 3, 227, 227), 'label': (256,)},
        'TEST': {'data': (50, 3, 227, 227), 'label': (50,)}},
    'BVLC_caffe__examples_mnist_mnist_autoencoder.prototxt': {
        'TRAIN': {'data': (100, 1, 28, 28)}, 'TEST': {'data': (100, 1, 28, 28)}},
    'BVLC_caffe__examples_hdf5_classification_train_val.prototxt': {
        'TRAIN': {'data': (10, 1), 'label': (10,)}, 'TEST': {'data': (10, 1), 'label': (10,)}},
    'yjxiong_caffe__models_semantic_segmentation_fcn_vgg_16_train.prototxt': {
        'TRAIN': {'data': (1, 3, 224, 224), 'label': (1, 1, 224, 224)}},
}


def _phase_inputs(net, phase):
    from caffe_syncbn.netparam.graph import filter_net

    # the autoencoder's TEST data layers need a stage
    return input_shapes(filter_net(net, caffe_pb2.NetState(phase=phase, stage=['test-on-test'])))


@pytest.mark.parametrize('name', sorted(DATA_NET_GUESSES))
def test_swap_guesses_data_shapes(name):
    net = swap_data_layers_for_inputs(corpus_net(name))
    for phase_name, expected in DATA_NET_GUESSES[name].items():
        assert _phase_inputs(net, getattr(caffe_pb2, phase_name)) == expected
    small = swap_data_layers_for_inputs(corpus_net(name), batch=2)
    for phase_name, expected in DATA_NET_GUESSES[name].items():
        got = _phase_inputs(small, getattr(caffe_pb2, phase_name))
        assert got == {top: (2,) + shape[1:] for top, shape in expected.items()}
    for phase_name, expected in DATA_NET_GUESSES[name].items():
        stages = ['test-on-test'] if phase_name == 'TEST' else []
        net = _build(small, getattr(caffe_pb2, phase_name), stages=stages)
        assert [net.blobs[top].shape for top in expected] == \
            [(2,) + shape[1:] for shape in expected.values()]


def test_swapped_train_val_nets_match_their_deploy_shapes():
    """AlexNet / LeNet train_val with their data swapped shape every blob as Caffe's deploy."""
    recorded = caffe_shapes() or pytest.skip('caffe_shapes.json is absent')
    pairs = [('BVLC_caffe__models_bvlc_alexnet_train_val.prototxt',
              'BVLC_caffe__models_bvlc_alexnet_deploy.prototxt'),
             ('BVLC_caffe__examples_mnist_lenet_train_test.prototxt',
              'BVLC_caffe__examples_mnist_lenet.prototxt')]
    for train_val, deploy in pairs:
        blobs = recorded[deploy]['TEST']['blobs']
        net = _build(swap_data_layers_for_inputs(corpus_net(train_val), batch=blobs['data'][0]),
                     caffe_pb2.TEST)
        for blob, shape in blobs.items():
            if blob in net.blobs:
                assert list(net.blobs[blob].shape) == shape, (train_val, blob)


def test_swap_rules_for_other_layer_types(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_blob_proto('mean.binaryproto', np.zeros((1, 3, 40, 50), np.float32))
    with h5py.File('part.h5', 'w') as f:
        f['feat'] = np.zeros((7, 12), np.float32)
        f['target'] = np.zeros((7,), np.float32)
    (tmp_path / 'list.txt').write_text('part.h5\n')
    net = parse('''
      layer { name: "mem" type: "MemoryData" top: "m" top: "ml"
              memory_data_param { batch_size: 5 channels: 2 height: 6 width: 7 } }
      layer { name: "img" type: "ImageData" top: "i" top: "il"
              image_data_param { source: "x" batch_size: 3 new_height: 20 new_width: 30
                                 is_color: false } }
      layer { name: "win" type: "WindowData" top: "w" top: "wl"
              window_data_param { source: "x" batch_size: 4 } transform_param { crop_size: 9 } }
      layer { name: "db" type: "Data" top: "d" transform_param { mean_file: "mean.binaryproto" }
              data_param { source: "x" batch_size: 8 } }
      layer { name: "h5" type: "HDF5Data" top: "feat" top: "target"
              hdf5_data_param { source: "list.txt" batch_size: 6 } }
      layer { name: "py" type: "Python" top: "p" top: "pl" python_param { module: "m" layer: "L" } }
      layer { name: "pyop" type: "Python" bottom: "p" top: "q"
              python_param { module: "m" layer: "L" } }
      layer { name: "dummy" type: "DummyData" top: "z" dummy_data_param { shape { dim: 2 } } }
      layer { name: "seg" type: "SegData" top: "s" top: "sl"
              transform_param { mean_value: 1 mean_value: 2 mean_value: 3 mean_value: 4
                                crop_size: 33 } }
      layer { name: "iseg" type: "ImageSegData" top: "g" top: "gl"
              image_data_param { source: "x" batch_size: 2 new_height: 5 new_width: 6 } }''')
    swapped = swap_data_layers_for_inputs(net, shapes={'sl': (1, 1, 9, 9)})
    assert input_shapes(swapped) == {
        'm': (5, 2, 6, 7), 'ml': (5,), 'i': (3, 1, 20, 30), 'il': (3,), 'w': (4, 3, 9, 9),
        'wl': (4,), 'd': (8, 3, 40, 50), 'feat': (6, 12), 'target': (6,),
        'p': (1, 3, 224, 224), 'pl': (1, 1, 224, 224), 's': (1, 4, 33, 33), 'sl': (1, 1, 9, 9),
        'g': (2, 3, 5, 6), 'gl': (2, 1, 5, 6)}
    assert [lp.type for lp in swapped.layer] == \
        ['Input'] * 6 + ['Python', 'DummyData', 'Input', 'Input']


def test_swap_shapes_resize_existing_inputs():
    net = parse('layer { name: "in" type: "Input" top: "a" top: "b" '
                '        input_param { shape { dim: 1 dim: 2 } } }')
    swapped = swap_data_layers_for_inputs(net, shapes={'b': [4, 5, 6]})
    assert input_shapes(swapped) == {'a': (1, 2), 'b': (4, 5, 6)}
    assert input_shapes(net) == {'a': (1, 2)}        # the argument is unchanged
