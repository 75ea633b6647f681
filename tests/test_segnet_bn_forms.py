"""SegNet's and ENet's BN beside the other batch norms: -sync_bn converts it keeping its
tops and settings, the start log says it keeps no running statistics, weights of the other
forms are refused in one line, fold-bn and to-batchnorm take INFERENCE mode (a per-channel
affine) and refuse or keep LEARN mode, ONNX runs it as onnxruntime computes it, and a
binary caffemodel of the forks (bn_param at their field 45) loads."""
import logging

import numpy as np
import pytest
from google.protobuf import text_format

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2, syncbn_policy
from caffe_syncbn.convert import fold_bn, to_batchnorm, to_syncbn
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.export import to_onnx
from caffe_syncbn.weights.norm_forms import norm_units
from helpers.onnx_helpers import assert_close, run

FILLERS = 'scale_filler { type: "constant" value: 1 } shift_filler { type: "constant" value: 0 }'
NET = '''name: "segnet"
layer { name: "data" type: "Input" top: "data"
        input_param { shape { dim: 2 dim: 3 dim: 6 dim: 7 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "bn" type: "BN" bottom: "conv" top: "conv" %s
        bn_param { %s bn_mode: %s } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
'''


def varint(value):
    out = bytearray()
    while True:
        out.append(value & 0x7f | (0x80 if value > 0x7f else 0))
        value >>= 7
        if not value:
            return bytes(out)


def net_param(mode='INFERENCE', tops=''):
    return text_format.Parse(NET % (tops, FILLERS, mode), caffe_pb2.NetParameter())


def trained(param, seed=0):
    net = caffe.Net(param, caffe.TEST, dtype=np.float64)
    rs = np.random.RandomState(seed)
    for blobs in net.params.values():
        for blob in blobs:
            blob.data[...] = rs.uniform(0.5, 1.5, blob.shape) * rs.choice([-1, 1], blob.shape)
    return net, {name: [b.data.copy() for b in blobs] for name, blobs in net.params.items()}


def outputs(param, weights, x):
    net = caffe.Net(param, caffe.TEST, dtype=np.float64)
    net.copy_from(weights)
    return net.forward(data=x)


def test_to_syncbn_keeps_the_forks_settings_and_statistics_tops():
    param = net_param('LEARN', 'top: "mean" top: "var"')
    converted, _ = to_syncbn(param)
    (bn,) = [layer for layer in converted.layer if layer.name == 'bn']
    assert bn.type == 'SyncBN' and list(bn.top) == ['conv', 'mean', 'var']
    assert bn.bn_param.bn_mode == caffe_pb2.BNParameter.LEARN
    assert bn.bn_param.HasField('scale_filler') and bn.bn_param.HasField('shift_filler')
    net = caffe.Net(converted, caffe.TRAIN)
    assert type(net.layer_by_name['bn']).__name__ == 'SyncSegNetBN'


def test_the_start_log_says_segnet_bn_keeps_no_statistics():
    param = net_param('LEARN')
    param.layer.add().CopyFrom(text_format.Parse(
        'name: "bn2" type: "BN" bottom: "conv" top: "conv" bn_param { momentum: 0.9 }',
        caffe_pb2.LayerParameter()))
    assert syncbn_policy.start_lines(param, norm_units(param.layer)) == [
        (logging.INFO, "--sync-bn: 2 layer(s) run as SyncBN (1 BN, 1 SegNet's BN)"),
        (logging.INFO, '--sync-bn: running statistics of the global batch, kept 1 as a '
                       'momentum average'),
        (logging.INFO, "--sync-bn: 1 of them (SegNet's BN) keep no running statistics: bn_mode "
                       "LEARN normalizes with the global batch's statistics in every phase, "
                       'INFERENCE applies scale and shift')]


def test_weights_of_pspnets_bn_are_refused_in_one_line():
    net = caffe.Net(net_param(), caffe.TEST)
    pspnet = {'bn': [np.ones((1, 4, 1, 1), np.float32)] * 4}
    with pytest.raises(CaffeError) as info:
        net.copy_from(pspnet)
    assert "layer 'bn' is SegNet's BN here (2 blobs: scale and shift), but the file holds 4 " \
           "blobs for it: PSPNet's and SegNet's BN layers do not share weights" in str(info.value)


def test_a_segnet_file_into_pspnets_bn_names_the_fork():
    text = NET.replace('bn_param { %s bn_mode: %s }', 'bn_param { momentum: 0.9 }') % ''
    net = caffe.Net(text_format.Parse(text, caffe_pb2.NetParameter()), caffe.TEST)
    with pytest.raises(CaffeError) as info:
        net.copy_from({'bn': [np.ones((1, 4, 1, 1), np.float32)] * 2})
    assert "2 are the scale and shift of SegNet's or ENet's BN, which a prototxt names by " \
           'bn_mode, scale_filler or shift_filler in bn_param' in str(info.value)


def test_fold_bn_folds_inference_mode_into_the_convolution():
    param = net_param()
    _, weights = trained(param)
    folded, folded_weights = fold_bn(param, weights)
    assert [layer.type for layer in folded.layer] == ['Input', 'Convolution', 'ReLU']
    x = np.random.RandomState(1).standard_normal((2, 3, 6, 7))
    np.testing.assert_allclose(outputs(folded, folded_weights, x)['conv'],
                               outputs(param, weights, x)['conv'], rtol=1e-5, atol=1e-5)


def test_fold_bn_leaves_learn_mode_which_normalizes_each_batch():
    param = net_param('LEARN')
    _, weights = trained(param)
    folded, _ = fold_bn(param, weights)
    assert [layer.type for layer in folded.layer] == ['Input', 'Convolution', 'BN', 'ReLU']


def test_to_batchnorm_makes_inference_mode_a_scale():
    param = net_param()
    _, weights = trained(param)
    converted, converted_weights = to_batchnorm(param, weights)
    (scale,) = [layer for layer in converted.layer if layer.name == 'bn']
    assert scale.type == 'Scale' and scale.scale_param.bias_term
    x = np.random.RandomState(2).standard_normal((2, 3, 6, 7))
    np.testing.assert_allclose(outputs(converted, converted_weights, x)['conv'],
                               outputs(param, weights, x)['conv'], rtol=1e-12)


def test_to_batchnorm_refuses_learn_mode_in_one_line():
    with pytest.raises(CaffeError) as info:
        to_batchnorm(net_param('LEARN'))
    assert str(info.value).startswith("to_batchnorm: layer 'bn' is SegNet's BN in LEARN mode, "
                                      "which normalizes with each batch's statistics")


@pytest.mark.parametrize('mode', ['LEARN', 'INFERENCE'])
def test_onnx_gives_what_the_layer_gives(mode):
    param = net_param(mode)
    net, weights = trained(param, seed=3)
    x = np.random.RandomState(4).standard_normal((2, 3, 6, 7)).astype(np.float32)
    want = net.forward(data=x.astype(np.float64))['conv']
    got = run(to_onnx(param, weights), {'data': x})
    assert_close(next(iter(got.values())), want, mode)


def test_a_binary_caffemodel_of_the_fork_loads():
    """SegNet and ENet keep bn_param at LayerParameter field 45, which is not this schema's
    bn_param: the settings are skipped as an unknown field, and the blobs load by name."""
    param = net_param()
    _, weights = trained(param, seed=5)
    model = caffe_pb2.NetParameter(name='segnet')
    for layer in param.layer:
        saved = model.layer.add()
        saved.CopyFrom(layer)
        saved.ClearField('bn_param')
        for array in weights.get(layer.name, []):
            saved.blobs.add(shape=caffe_pb2.BlobShape(dim=array.shape),
                            data=array.astype(np.float32).ravel())
    raw = bytearray()
    for layer in model.layer:
        body = layer.SerializeToString()
        if layer.name == 'bn':                 # the fork's bn_param { bn_mode: INFERENCE }
            body += varint(45 << 3 | 2) + varint(2) + bytes([3 << 3, 1])
        raw += varint(100 << 3 | 2) + varint(len(body)) + body
    net = caffe.Net(param, caffe.TEST)
    net.copy_from(caffe_pb2.NetParameter.FromString(bytes(raw)))
    np.testing.assert_array_equal(net.params['bn'][0].data, weights['bn'][0].astype(np.float32))


SEGNET_TRAIN = '''name: "segnet_style"
layer { name: "data" type: "DenseImageData" top: "data" top: "label"
  dense_image_data_param { source: "%(root)s/train.txt" root_folder: "%(root)s/"
                           batch_size: %(batch)d
                           mirror: true crop_height: 8 crop_width: 9 } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "conv1_bn" type: "BN" bottom: "conv1" top: "conv1"
  bn_param { scale_filler { type: "constant" value: 1 }
             shift_filler { type: "constant" value: 0.001 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv_classifier" type: "Convolution" bottom: "conv1" top: "conv_classifier"
  convolution_param { num_output: 3 kernel_size: 1 weight_filler { type: "msra" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "conv_classifier" bottom: "label" top: "loss"
  loss_param { weight_by_label_freqs: true ignore_label: 11
               class_weighting: 0.5 class_weighting: 1.5 class_weighting: 3 } }
'''


def segnet_images(folder):
    """Six small images and label images, and their DenseImageData list."""
    cv2 = pytest.importorskip('cv2')
    rs = np.random.RandomState(0)
    lines = []
    for i in range(6):
        labels = rs.randint(0, 3, (10, 12)).astype(np.uint8)
        labels[rs.rand(10, 12) < 0.1] = 11
        image = (np.minimum(labels, 2)[..., None] * 70 + rs.randint(0, 40, (10, 12, 3)))
        cv2.imwrite(str(folder / ('%d.png' % i)), image.astype(np.uint8))
        cv2.imwrite(str(folder / ('%d_label.png' % i)), labels)
        lines.append('%d.png %d_label.png\n' % (i, i))
    (folder / 'train.txt').write_text(''.join(lines))


def train_segnet(folder, devices, batch, **kwargs):
    """The params after 3 steps of SEGNET_TRAIN on ``devices`` of ``batch`` images each."""
    name = '%s%s' % (devices.replace(':', ''), ''.join('_%s%s' % kv for kv in kwargs.items()))
    net = folder / ('%s.prototxt' % name)
    net.write_text(SEGNET_TRAIN % {'root': folder, 'batch': batch})
    solver_file = folder / ('%s_solver.prototxt' % name)
    solver_file.write_text('net: "%s" base_lr: 0.05 momentum: 0.9 lr_policy: "fixed" '
                           'max_iter: 10 display: 0 random_seed: 3 snapshot_prefix: "%s"'
                           % (net, folder / 'snap'))
    solver = caffe.get_solver(str(solver_file), devices=devices, **kwargs)
    try:
        expected = 'SyncSegNetBN' if kwargs.get('sync_bn') else 'SegNetBN'
        assert type(solver.net.layer_by_name['conv1_bn']).__name__ == expected
        solver.step(3)
        return {name: [b.data.copy() for b in blobs] for name, blobs in solver.net.params.items()}
    finally:
        solver.close()


def assert_same_params(found, expected, **tolerance):
    for name, blobs in expected.items():
        for j, blob in enumerate(blobs):
            np.testing.assert_allclose(found[name][j], blob, err_msg='%s[%d]' % (name, j),
                                       **tolerance)


def test_a_segnet_net_trains_under_sync_bn_on_two_devices_as_on_one(tmp_path):
    """SegNet's BN as SyncBN, DenseImageData's flips and crops drawn per image, the
    class-weighted loss: 2 devices x 2 images train as 1 device x 4 images."""
    segnet_images(tmp_path)
    two = train_segnet(tmp_path, 'cpu:2', 2, sync_bn=True)
    one = train_segnet(tmp_path, 'cpu:1', 4, sync_bn=True)
    assert_same_params(two, one, rtol=2e-4, atol=2e-5)
    assert np.any(one['conv1_bn'][0] != 1)          # the scale learned


def test_segnet_bn_in_groups_of_one_is_segnet_bn_on_each_device(tmp_path):
    """-sync_bn_group_size 1 on 2 devices: each replica normalizes with its own batch, as
    SegNet's BN does without -sync_bn; groups of 2 are the global batch, another thing."""
    segnet_images(tmp_path)
    alone = train_segnet(tmp_path, 'cpu:2', 2, sync_bn=True, sync_bn_group_size=1)
    assert_same_params(alone, train_segnet(tmp_path, 'cpu:2', 2), rtol=1e-5, atol=1e-6)
    synced = train_segnet(tmp_path, 'cpu:2', 2, sync_bn=True, sync_bn_group_size=2)
    assert not np.allclose(alone['conv1_bn'][0], synced['conv1_bn'][0], rtol=1e-4, atol=1e-5)
