"""NVCaffe's BatchNorm with scale_bias in and out of the package: its caffemodels as NVCaffe
writes them (raw FLOAT16 and FLOAT blobs, its own LayerParameter fields) load as they are,
its weights move to BVLC BatchNorm + Scale and to SyncBN and back with TEST outputs kept,
OpenCV and onnxruntime agree, fold_bn folds it, and -sync_bn trains it on two devices as
NVCaffe's BatchNorm trains on one with the whole batch, snapshots in NVCaffe's blobs."""
import logging
import os

import h5py
import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.convert import fold_bn, to_batchnorm, to_syncbn
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.formats.blobs import length_delimited
from caffe_syncbn.formats.caffemodel import read_weights
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.training.solvers import get_solver
from caffe_syncbn.training.start_log import log_sync_bn
from caffe_syncbn.weights.copy import arrays_of
from helpers.net_helpers import input_layer
from helpers.paths import ROOT

SHAPE = (2, 3, 5, 4)
NET = input_layer('data', *SHAPE) + '''
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv"
        batch_norm_param { scale_bias: true eps: 0.001 moving_average_fraction: 0.9 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
'''


def param_of(text):
    return parse_text(text, caffe_pb2.NetParameter())


def nvcaffe_weights(seed=0):
    rng = np.random.default_rng(seed)
    return {'conv': [rng.standard_normal((4, 3, 1, 1)), rng.standard_normal(4)],
            'bn': [rng.normal(1, 1, 4), rng.uniform(0.5, 3, 4), np.ones(1),
                   rng.uniform(0.5, 2, 4), rng.normal(0, 1, 4)]}


RAW = {caffe_pb2.BlobProto.FLOAT16: '<f2', caffe_pb2.BlobProto.FLOAT: '<f4',
       caffe_pb2.BlobProto.DOUBLE: '<f8'}


def raw_blob(values, kind):
    """A BlobProto as NVCaffe's Blob::ToProto writes it: shape, raw bytes and their type."""
    blob = caffe_pb2.BlobProto(raw_data_type=kind)
    blob.shape.dim.extend(np.shape(values))
    blob.raw_data = np.asarray(values, RAW[kind]).tobytes()
    return blob


#: NVCaffe's LayerParameter fields 145-148 (forward_type ... backward_math: FLOAT16 = 2),
#: BVLC's numbers of parameter_param ... clip_param, which hold messages here
NVCAFFE_TYPES = b''.join(bytes([(number << 3) & 0x7f | 0x80, number >> 4, 2])
                         for number in (145, 146, 147, 148))


def write_nvcaffe_caffemodel(path, weights, kind):
    """The weights as an NVCaffe 0.17 snapshot holds them, in blobs of ``kind``."""
    out = b''
    for layer in param_of(NET).layer:
        layer.ClearField('bottom')
        for values in weights.get(layer.name, []):
            layer.blobs.add().CopyFrom(raw_blob(values, kind))
        out += length_delimited(100, layer.SerializeToString() + NVCAFFE_TYPES)
    with open(path, 'wb') as f:
        f.write(length_delimited(1, b'nvcaffe') + out)


def nvcaffe_test_output(weights, x):
    """Convolution, NVCaffe's TEST BatchNorm (blobs 0 and 1 as they are), ReLU, in float64."""
    w, b = weights['conv']
    conv = np.einsum('nchw,kc->nkhw', x, w.reshape(4, 3)) + b.reshape(1, 4, 1, 1)
    mean, var, _, scale, shift = (np.reshape(v, (1, -1, 1, 1)) for v in weights['bn'])
    return np.maximum(scale * (conv - mean) / np.sqrt(var + float(np.float32(0.001))) + shift, 0)


def half(weights):
    return {k: [np.asarray(a, np.float16).astype(np.float64) for a in v]
            for k, v in weights.items()}


@pytest.mark.parametrize('kind', [caffe_pb2.BlobProto.FLOAT16, caffe_pb2.BlobProto.FLOAT,
                                  caffe_pb2.BlobProto.DOUBLE])
def test_an_nvcaffe_caffemodel_loads_as_it_is(tmp_path, kind):
    weights = nvcaffe_weights()
    if kind == caffe_pb2.BlobProto.FLOAT16:
        weights = half(weights)
    model = tmp_path / 'nv.caffemodel'
    write_nvcaffe_caffemodel(model, weights, kind)
    net = caffe.Net(param_of(NET), caffe.TEST, weights=str(model), dtype=np.float64)
    for name, values in weights.items():
        for blob, value in zip(net.params[name], values):
            np.testing.assert_array_equal(blob.data, np.asarray(value, RAW[kind]))
    x = np.random.default_rng(1).standard_normal(SHAPE)
    np.testing.assert_allclose(net.forward(data=x)['conv'], nvcaffe_test_output(weights, x),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('change, message', [
    (lambda blob: blob.ClearField('raw_data_type'),
     'blob holds NVCaffe raw_data without its raw_data_type'),
    (lambda blob: setattr(blob, 'raw_data_type', caffe_pb2.BlobProto.INT),
     'blob holds NVCaffe raw_data of type INT; weights are DOUBLE, FLOAT or FLOAT16'),
    (lambda blob: setattr(blob, 'raw_data', blob.raw_data[:-1]),
     'blob holds 23 bytes of NVCaffe raw_data, not a whole number of FLOAT16 values'),
])
def test_a_bad_raw_blob_is_one_line(tmp_path, change, message):
    param = param_of(NET)
    weights = nvcaffe_weights()
    blobs = [raw_blob(values, caffe_pb2.BlobProto.FLOAT16) for values in weights['conv']]
    change(blobs[0])
    layer = next(layer for layer in param.layer if layer.name == 'conv')
    layer.blobs.extend(blobs)
    model = tmp_path / 'bad.caffemodel'
    model.write_bytes(param.SerializeToString())
    with pytest.raises(CaffeError) as info:
        caffe.Net(param_of(NET), caffe.TEST, weights=str(model))
    assert '\n' not in str(info.value) and message in str(info.value)


def test_to_batchnorm_keeps_the_test_output_and_opencv_agrees(tmp_path):
    weights = nvcaffe_weights(2)
    param, converted = to_batchnorm(param_of(NET), weights)
    assert [layer.type for layer in param.layer] == ['Input', 'Convolution', 'BatchNorm', 'Scale',
                                                     'ReLU']
    assert param.layer[2].batch_norm_param.eps == pytest.approx(0.001)
    assert not param.layer[2].batch_norm_param.HasField('scale_bias')
    x = np.random.default_rng(3).standard_normal(SHAPE)
    net = caffe.Net(param, caffe.TEST, weights=converted, dtype=np.float64)
    np.testing.assert_allclose(net.forward(data=x)['conv'], nvcaffe_test_output(weights, x),
                               rtol=1e-6, atol=1e-6)
    cv2 = pytest.importorskip('cv2', reason='pip install "opencv-python-headless<5"')
    prototxt, model = tmp_path / 'nv.prototxt', tmp_path / 'nv.caffemodel'
    prototxt.write_text(NET)
    nvcaffe = caffe.Net(param_of(NET), caffe.TEST, weights=weights)
    nvcaffe.save(str(model))
    reference = cv2.dnn.readNetFromCaffe(str(prototxt), str(model))
    reference.setInput(x.astype(np.float32))
    np.testing.assert_allclose(reference.forward('relu'), nvcaffe_test_output(weights, x),
                               rtol=1e-4, atol=1e-5)


def test_to_syncbn_keeps_nvcaffes_statistics_and_comes_back():
    weights = nvcaffe_weights(4)
    param, synced = to_syncbn(param_of(NET), weights)
    bn = param.layer[2]
    assert bn.type == 'SyncBN'
    assert bn.bn_param.statistics == caffe_pb2.BNParameter.NVCAFFE
    assert bn.bn_param.momentum == pytest.approx(0.9) and bn.bn_param.eps == pytest.approx(0.001)
    assert [(p.lr_mult, p.decay_mult) for p in bn.param] == [(1, 1), (1, 1)]
    assert [a.shape for a in synced['bn']] == [(1, 4, 1, 1)] * 4
    x = np.random.default_rng(5).standard_normal(SHAPE)
    net = caffe.Net(param, caffe.TEST, weights=synced, dtype=np.float64)
    np.testing.assert_allclose(net.forward(data=x)['conv'], nvcaffe_test_output(weights, x),
                               rtol=1e-12, atol=1e-12)
    small_eps = NET.replace('eps: 0.001', 'eps: 1e-9')           # NVCaffe's least is 1e-5
    assert to_syncbn(param_of(small_eps))[0].layer[2].bn_param.eps == pytest.approx(1e-5)


def test_fold_bn_and_onnx(tmp_path):
    weights = nvcaffe_weights(6)
    x = np.random.default_rng(7).standard_normal(SHAPE)
    expected = nvcaffe_test_output(weights, x)
    param, folded = fold_bn(param_of(NET), weights)
    assert [layer.type for layer in param.layer] == ['Input', 'Convolution', 'ReLU']
    net = caffe.Net(param, caffe.TEST, weights=folded, dtype=np.float64)
    np.testing.assert_allclose(net.forward(data=x)['conv'], expected, rtol=1e-5, atol=1e-5)
    pytest.importorskip('onnxruntime')
    from caffe_syncbn.export import to_onnx
    from helpers.onnx_helpers import run
    outputs = run(to_onnx(param_of(NET), weights), {'data': x.astype(np.float32)})
    np.testing.assert_allclose(outputs['conv'], expected, rtol=1e-5, atol=1e-5)


# ---- training under -sync_bn ----------------------------------------------------------------
GOLDEN = ROOT / 'tests' / 'batchnorm_golden'
ITERS, SNAPSHOT_AT, GLOBAL_BATCH = 6, 3, 8


def nvcaffe_classifier():
    """The BatchNorm golden's classifier with NVCaffe's BatchNorm in place of BatchNorm +
    Scale."""
    text = (GOLDEN / 'bn_classifier.prototxt').read_text()
    for k in (1, 2):
        text = text.replace(
            'layer { name: "bn%d" type: "BatchNorm" bottom: "conv%d" top: "conv%d" }\n'
            'layer { name: "scale%d" type: "Scale" bottom: "conv%d" top: "conv%d" '
            'scale_param { bias_term: true } }' % ((k,) * 6),
            'layer { name: "bn%d" type: "BatchNorm" bottom: "conv%d" top: "conv%d" '
            'batch_norm_param { scale_bias: true moving_average_fraction: 0.9 } }' % ((k,) * 3))
    assert text.count('scale_bias') == 2
    return text


def write_job(folder, per_device):
    golden = np.load(GOLDEN / 'bn_classifier.npz')
    for split in ('train', 'test'):
        with h5py.File(folder / (split + '.h5'), 'w') as f:
            f['data'] = golden['input/%s_data' % split]
            f['label'] = golden['input/%s_label' % split]
        (folder / (split + '.txt')).write_text(split + '.h5\n')
    train_layer = 'source: "train.txt" batch_size: %d'
    (folder / 'net.prototxt').write_text(nvcaffe_classifier().replace(
        train_layer % GLOBAL_BATCH, train_layer % per_device))
    solver = (GOLDEN / 'bn_classifier.solver.prototxt').read_text()
    (folder / 'solver.prototxt').write_text(solver.replace('bn_classifier.prototxt',
                                                           'net.prototxt'))
    return str(folder / 'solver.prototxt')


def train(folder, devices, sync_bn):
    os.chdir(folder)
    job = write_job(folder, GLOBAL_BATCH // int(devices.split(':')[1]))
    out = {}
    solver = get_solver(job, devices=devices, sync_bn=sync_bn,
                        weights=[str(GOLDEN / 'init.caffemodel')])
    try:
        for it in range(1, ITERS + 1):
            solver.step(1)
            if it == SNAPSHOT_AT:
                model, _ = solver.snapshot()
        out['test'] = solver.test(0)
    finally:
        solver.close()
    out['snapshot'] = arrays_of(read_weights(model))
    return out


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    before = os.getcwd()
    try:
        return {(devices, sync_bn): train(tmp_path_factory.mktemp('run'), devices, sync_bn)
                for devices, sync_bn in (('cpu:2', True), ('cpu:1', False))}
    finally:
        os.chdir(before)


def test_sync_bn_trains_nvcaffes_batchnorm_as_one_device_does(runs):
    """Two devices under -sync_bn: the snapshot holds NVCaffe's five blobs, those of its
    BatchNorm on one device with the whole batch, and TEST scores agree."""
    synced, plain = runs[('cpu:2', True)], runs[('cpu:1', False)]
    for name in ('bn1', 'bn2'):
        written = synced['snapshot'][name]
        assert [a.shape for a in written] == [(8,), (8,), (1,), (8,), (8,)]
        assert written[2].tolist() == [1.0]
        for mine, theirs in zip(written, plain['snapshot'][name]):
            np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)
    for key, value in plain['test'].items():
        assert synced['test'][key] == pytest.approx(value, rel=1e-4), key


def test_sync_bn_says_it_keeps_nvcaffes_average(caplog):
    with caplog.at_level(logging.INFO, logger='caffe_syncbn'):
        log_sync_bn(param_of(nvcaffe_classifier()))
    assert "2 layer(s) run as SyncBN (2 NVCaffe's BatchNorm)" in caplog.text
    assert ("running statistics of the global batch, kept 2 as NVCaffe's average (its first "
            'update copies)') in caplog.text
