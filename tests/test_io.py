"""Weights I/O: binary caffemodels (V1/V2), Caffe's HDF5 layout, .binaryproto, atomic writes."""
import logging
import os
import sys
import textwrap

import h5py
import numpy as np
import pytest
from helpers import watchdog

from caffe_syncbn import caffe_pb2
from caffe_syncbn.blob import Blob
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.formats.atomic import atomic_write
from caffe_syncbn.formats.blobs import (array_to_blob, blob_to_array, read_blob_proto,
                                        write_blob_proto)
from caffe_syncbn.formats.caffemodel import read_net_param
from caffe_syncbn.weights.copy import copy_weights, layer_blobs
from caffe_syncbn.weights.save import net_to_proto, write_caffemodel, write_hdf5

from helpers.paths import GOLDEN, ROOT, require


class FakeLayer:
    def __init__(self, param, blobs=(), phase=caffe_pb2.TEST):
        self.param, self.blobs, self.phase = param, list(blobs), phase


class FakeNet:
    """The minimal interface the weight functions use: name, layers, _layer_names and
    layer_by_name."""

    def __init__(self, name, layers):
        self.name = name
        self.layers, self._layer_names, self.layer_by_name = [], [], {}
        for layer in layers:
            self.add(layer)

    def add(self, layer):
        self.layers.append(layer)
        self._layer_names.append(layer.param.name)
        self.layer_by_name[layer.param.name] = layer


def blob_of(array, dtype=np.float32):
    blob = Blob(np.shape(array), dtype)
    blob.data[...] = array
    return blob


def net_from_caffemodel(path, zero=False):
    """A FakeNet holding the layers and weights (or zeros) of a V2 caffemodel."""
    layers = []
    for lp in read_net_param(path).layer:
        param = caffe_pb2.LayerParameter()
        param.CopyFrom(lp)
        param.ClearField('blobs')
        arrays = [blob_to_array(b) for b in lp.blobs]
        layers.append(FakeLayer(param, [blob_of(np.zeros_like(a) if zero else a) for a in arrays]))
    return FakeNet(read_net_param(path).name, layers)


def small_net(dtype=np.float32):
    rs = np.random.RandomState(0)
    conv = FakeLayer(caffe_pb2.LayerParameter(name='conv', type='Convolution'),
                     [blob_of(rs.randn(4, 3, 3, 3), dtype), blob_of(rs.randn(4), dtype)])
    ip = FakeLayer(caffe_pb2.LayerParameter(name='ip', type='InnerProduct'),
                   [blob_of(rs.randn(5, 6), dtype), blob_of(rs.randn(5), dtype)])
    relu = FakeLayer(caffe_pb2.LayerParameter(name='relu', type='ReLU'))
    return FakeNet('small', [conv, relu, ip])


def all_arrays(net):
    return {name: [b.data.copy() for b in layer.blobs] for name, layer in net.layer_by_name.items()}


def zero(net):
    for layer in net.layer_by_name.values():
        for blob in layer.blobs:
            blob.data[...] = 0


# ---- blobs ------------------------------------------------------------------------------
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('shape', [(2, 3, 4, 5), (7,), (), (0, 3), (1, 2, 3, 4, 5)])
def test_blob_round_trip(shape, dtype):
    array = np.asarray(np.random.RandomState(1).randn(*shape), dtype)
    proto = caffe_pb2.BlobProto.FromString(array_to_blob(array).SerializeToString())
    back = blob_to_array(proto)
    assert back.shape == shape and (back.dtype == dtype or array.size == 0)
    np.testing.assert_array_equal(back, array)
    assert (len(proto.double_data) > 0) == (dtype == np.float64 and array.size > 0)


def test_blob_legacy_shape_and_count_check():
    proto = caffe_pb2.BlobProto(num=1, channels=2, height=1, width=3, data=range(6))
    assert blob_to_array(proto).shape == (1, 2, 1, 3)
    proto.data.append(7)
    with pytest.raises(CaffeError, match='holds 7 values, expected 6'):
        blob_to_array(proto)


def test_binaryproto_round_trip(tmp_path):
    path = tmp_path / 'mean.binaryproto'
    mean = np.arange(24, dtype=np.float32).reshape(1, 3, 2, 4)
    write_blob_proto(path, mean)
    np.testing.assert_array_equal(read_blob_proto(path), mean)
    assert os.listdir(tmp_path) == ['mean.binaryproto']    # no temp file left behind


# ---- binary caffemodel ------------------------------------------------------------------
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_caffemodel_round_trip(tmp_path, dtype):
    net = small_net(dtype)
    expected = all_arrays(net)
    path = tmp_path / 'w.caffemodel'
    write_caffemodel(net, path)
    param = read_net_param(path)
    assert param.name == 'small'
    assert [lp.name for lp in param.layer] == ['conv', 'relu', 'ip']
    assert all(lp.phase == caffe_pb2.TEST for lp in param.layer)
    blobs = [b for lp in param.layer for b in lp.blobs]
    assert all(b.HasField('shape') and not b.HasField('num') for b in blobs)
    assert param == net_to_proto(net)
    zero(net)
    copy_weights(net, path)
    for name, arrays in expected.items():
        for got, want in zip(net.layer_by_name[name].blobs, arrays):
            np.testing.assert_array_equal(got.data, want)


def test_write_is_byte_identical_to_caffe():
    """Rewriting the weights of every golden V2 caffemodel gives Caffe's exact bytes."""
    paths = [p for p in sorted(require(GOLDEN).glob('*.caffemodel'))
             if not read_net_param(p).layers]
    assert len(paths) > 20
    for path in paths:
        written = net_to_proto(net_from_caffemodel(path)).SerializeToString()
        assert written == path.read_bytes(), path.name


def test_write_caffemodel_streams_the_same_bytes(tmp_path):
    path = require(GOLDEN / 'format_hdf5_caffemodel.caffemodel')
    write_caffemodel(net_from_caffemodel(path), tmp_path / 'x.caffemodel')
    assert (tmp_path / 'x.caffemodel').read_bytes() == path.read_bytes()


def test_v1_caffemodel_blobs_equal_v2():
    v1 = layer_blobs(read_net_param(require(GOLDEN / 'format_v1_caffemodel.v1.caffemodel')))
    v2 = layer_blobs(read_net_param(GOLDEN / 'format_v1_caffemodel.caffemodel'))
    assert [a.shape for a in v1['ip1']] == [(1, 1, 5, 100), (1, 1, 1, 5)]   # legacy 4-D
    for name, arrays in v2.items():
        assert len(v1.get(name, [])) == len(arrays)
        for a1, a2 in zip(v1.get(name, []), arrays):
            np.testing.assert_array_equal(a1.reshape(a2.shape), a2)


def test_copy_v1_weights_into_v2_shapes():
    target = net_from_caffemodel(require(GOLDEN / 'format_v1_caffemodel.caffemodel'), zero=True)
    copy_weights(target, GOLDEN / 'format_v1_caffemodel.v1.caffemodel')
    expected = layer_blobs(read_net_param(GOLDEN / 'format_v1_caffemodel.caffemodel'))
    for name, arrays in expected.items():
        for blob, want in zip(target.layer_by_name[name].blobs, arrays):
            np.testing.assert_array_equal(blob.data, want)


def test_legacy_blob_must_match_the_left_padded_shape():
    proto = caffe_pb2.NetParameter()
    layer = proto.layers.add(name='ip', type=caffe_pb2.V1LayerParameter.INNER_PRODUCT)
    layer.blobs.add(num=1, channels=1, height=6, width=5, data=np.arange(30.0))
    net = FakeNet('n', [FakeLayer(caffe_pb2.LayerParameter(name='ip'), [Blob((5, 6))])])
    with pytest.raises(CaffeError, match=r"blob 0 of layer 'ip'.*\[1, 1, 6, 5\].*\[5, 6\]"):
        copy_weights(net, proto)    # same count, but Caffe rejects a transposed legacy shape


def test_copy_skips_layers_the_net_lacks(tmp_path, caplog):
    net = small_net()
    path = tmp_path / 'w.caffemodel'
    write_caffemodel(net, path)
    del net.layer_by_name['ip']
    with caplog.at_level(logging.INFO, logger='caffe_syncbn'):
        copy_weights(net, path)
    assert 'Ignoring source layer ip' in caplog.text
    # the net's own 'ip' (no longer found by name) got nothing, and is named
    assert "has weights for 1 of the 2 layers with params of net 'small'; the other 1 keep " \
        "their initial values: 'ip'" in caplog.text


def test_copy_shape_mismatch_names_everything(tmp_path):
    path = tmp_path / 'w.caffemodel'
    write_caffemodel(small_net(), path)
    net = small_net()
    net.layer_by_name['ip'].blobs[0] = Blob((5, 7))
    with pytest.raises(CaffeError) as info:
        copy_weights(net, path)
    message = str(info.value)
    for part in (str(path), "layer 'ip'", 'blob 0', '[5, 6]', '[5, 7]'):
        assert part in message


def test_copy_blob_count_mismatch(tmp_path):
    path = tmp_path / 'w.caffemodel'
    write_caffemodel(small_net(), path)
    net = small_net()
    net.layer_by_name['ip'].blobs.pop()
    with pytest.raises(CaffeError, match=r"w.caffemodel: layer 'ip' has 2 blob\(s\) in the file "
                                         r"but 1 in the net"):
        copy_weights(net, path)


# ---- corrupt files ----------------------------------------------------------------------
def test_truncated_caffemodel(tmp_path):
    data = require(GOLDEN / 'format_hdf5_caffemodel.caffemodel').read_bytes()
    for cut in (len(data) // 3, len(data) - 3, 7):
        path = tmp_path / ('cut%d.caffemodel' % cut)
        path.write_bytes(data[:cut])
        with pytest.raises(CaffeError, match='cut%d.caffemodel.*truncated or corrupt' % cut):
            copy_weights(small_net(), path)


def test_garbage_empty_missing_and_wrong_kind(tmp_path):
    garbage = tmp_path / 'garbage.caffemodel'
    garbage.write_bytes(np.random.RandomState(0).bytes(5000))
    with pytest.raises(CaffeError, match='garbage.caffemodel'):
        read_net_param(garbage)
    empty = tmp_path / 'empty.caffemodel'
    empty.write_bytes(b'')
    with pytest.raises(CaffeError, match='empty.caffemodel: the file is empty'):
        read_net_param(empty)
    with pytest.raises(CaffeError, match='missing.caffemodel does not exist'):
        copy_weights(small_net(), tmp_path / 'missing.caffemodel')
    h5 = tmp_path / 'weights.bin'
    write_hdf5(small_net(), h5)
    with pytest.raises(CaffeError, match='is an HDF5 file'):
        read_net_param(h5)
    copy_weights(small_net(), h5)        # detected by its magic bytes despite the suffix
    broken = tmp_path / 'broken.h5'
    broken.write_bytes(h5.read_bytes()[:200])
    with pytest.raises(CaffeError, match='broken.h5'):
        copy_weights(small_net(), broken)


BIG_SCRIPT = textwrap.dedent('''
    import sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[3])
    from caffe_syncbn import caffe_pb2
    from caffe_syncbn.blob import Blob
    from caffe_syncbn.formats.caffemodel import read_net_param
    from caffe_syncbn.weights.copy import copy_weights
    from caffe_syncbn.weights.save import write_caffemodel

    class Layer:
        def __init__(self, name, shape):
            self.param = caffe_pb2.LayerParameter(name=name, type='InnerProduct')
            self.blobs, self.phase = [Blob(shape)], 1

    class Net:
        name = 'big'

    net = Net()
    net.layers = [Layer('fc%d' % i, (25000, 1000)) for i in range(int(sys.argv[2]))]  # 100 MB each
    for i, layer in enumerate(net.layers):
        layer.blobs[0].data[...] = i
        layer.blobs[0].data[-1, -3:] = [-1, -2, -3]
    net._layer_names = [layer.param.name for layer in net.layers]
    net.layer_by_name = dict(zip(net._layer_names, net.layers))
    start = time.time()
    write_caffemodel(net, sys.argv[1])
    for layer in net.layer_by_name.values():
        layer.blobs[0].data[...] = 0
    param = read_net_param(sys.argv[1])
    copy_weights(net, param)
    seconds = time.time() - start
    for i, layer in enumerate(net.layer_by_name.values()):
        assert layer.blobs[0].data[0, 0] == i and list(layer.blobs[0].data[-1, -3:]) == [-1, -2, -3]
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child of a big pytest
    # worker would report the worker's peak
    with open('/proc/self/status') as status:
        peak_kb = next(int(line.split()[1]) for line in status if line.startswith('VmHWM:'))
    print(seconds, peak_kb / 1e6)
''')


def test_600mb_caffemodel(tmp_path):
    """VGG-16 size: no protobuf size limit, and under 3 GB (the net itself holds 0.6 GB)."""
    path = tmp_path / 'big.caffemodel'
    out = watchdog.run([sys.executable, '-c', BIG_SCRIPT, str(path), '6', str(ROOT)],
                       capture_output=True, text=True, limit=120)
    assert out.returncode == 0, out.stderr
    assert path.stat().st_size > 600e6
    _, gigabytes = map(float, out.stdout.split())
    assert gigabytes < 3.0, gigabytes


# ---- HDF5 -------------------------------------------------------------------------------
def _h5_layout(path):
    items = {}
    with h5py.File(path, 'r') as f:
        items['/'] = dict(f.attrs)
        f.visititems(lambda name, obj: items.__setitem__(name, (
            type(obj).__name__, getattr(obj, 'shape', None), str(getattr(obj, 'dtype', '')),
            dict(obj.attrs), getattr(obj, 'chunks', None), getattr(obj, 'compression', None))))
    return items


def test_hdf5_mirrors_caffe_layout(tmp_path):
    golden_h5 = require(GOLDEN / 'format_hdf5_caffemodel.caffemodel.h5')
    net = net_from_caffemodel(GOLDEN / 'format_hdf5_caffemodel.caffemodel')
    path = tmp_path / 'w.caffemodel.h5'
    write_hdf5(net, path)
    assert _h5_layout(path) == _h5_layout(golden_h5)
    with h5py.File(path, 'r') as mine, h5py.File(golden_h5, 'r') as theirs:
        def same(name, obj):
            if isinstance(obj, h5py.Dataset):
                np.testing.assert_array_equal(mine[name][()], obj[()])
        theirs.visititems(same)


def test_golden_h5_equals_caffemodel():
    from_h5 = net_from_caffemodel(require(GOLDEN / 'format_hdf5_caffemodel.caffemodel'), zero=True)
    copy_weights(from_h5, GOLDEN / 'format_hdf5_caffemodel.caffemodel.h5')
    expected = layer_blobs(read_net_param(GOLDEN / 'format_hdf5_caffemodel.caffemodel'))
    for name, arrays in expected.items():
        for blob, want in zip(from_h5.layer_by_name[name].blobs, arrays):
            np.testing.assert_array_equal(blob.data, want)


def test_hdf5_round_trip_and_errors(tmp_path):
    net = small_net()
    expected = all_arrays(net)
    path = tmp_path / 'w.h5'
    write_hdf5(net, path)
    zero(net)
    copy_weights(net, path)
    for name, arrays in expected.items():
        for got, want in zip(net.layer_by_name[name].blobs, arrays):
            np.testing.assert_array_equal(got.data, want)
    net.layer_by_name['conv'].blobs[1] = Blob((3,))
    with pytest.raises(CaffeError, match=r"w.h5: cannot copy blob 1 of layer 'conv'.*\[4\].*\[3\]"):
        copy_weights(net, path)
    net = small_net()
    net.layer_by_name['ip'].blobs.append(Blob((2,)))
    with pytest.raises(CaffeError, match="layer 'ip' lacks blob 2"):
        copy_weights(net, path)


def test_hdf5_shared_params_stored_once(tmp_path):
    net = small_net()
    shared = FakeLayer(caffe_pb2.LayerParameter(name='ip_copy', type='InnerProduct'),
                       net.layer_by_name['ip'].blobs)
    net.add(shared)
    path = tmp_path / 'shared.h5'
    write_hdf5(net, path)
    with h5py.File(path, 'r') as f:
        assert list(f['data/ip_copy']) == [] and list(f['data/ip']) == ['0', '1']
    copy_weights(net, path)              # the sharer's missing datasets are fine


def test_hdf5_nested_layer_names(tmp_path):
    """'conv1' and 'conv1/bn' (DenseNet style): the group of one holds the other."""
    rs = np.random.RandomState(3)
    net = FakeNet('n', [
        FakeLayer(caffe_pb2.LayerParameter(name='conv1/bn'), [blob_of(rs.randn(3))]),
        FakeLayer(caffe_pb2.LayerParameter(name='conv1'), [blob_of(rs.randn(3, 2))])])
    expected = all_arrays(net)
    write_hdf5(net, tmp_path / 'n.h5')
    zero(net)
    copy_weights(net, tmp_path / 'n.h5')
    for name, arrays in expected.items():
        np.testing.assert_array_equal(net.layer_by_name[name].blobs[0].data, arrays[0])


# ---- atomic writes ----------------------------------------------------------------------
def test_interrupted_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / 'w.caffemodel'
    write_caffemodel(small_net(), path)
    before = path.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(path) as f:
            f.write(b'half of a file')
            raise KeyboardInterrupt
    assert path.read_bytes() == before
    from caffe_syncbn.formats import caffemodel
    calls = []

    def fail_on_third_blob(array, proto=None):       # fails in the middle of the file
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError
        return array_to_blob(array, proto)
    monkeypatch.setattr(caffemodel, 'array_to_blob', fail_on_third_blob)
    with pytest.raises(MemoryError):
        write_caffemodel(small_net(), path)
    monkeypatch.setattr(caffemodel, 'to_numpy', lambda a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        write_hdf5(small_net(), tmp_path / 'w.h5')
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ['w.caffemodel']


def test_written_files_are_readable_by_others(tmp_path):
    write_caffemodel(small_net(), tmp_path / 'w.caffemodel')
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / 'w.caffemodel').stat().st_mode & 0o777 == 0o666 & ~umask


# ---- the real Net -----------------------------------------------------------------------
def _net_or_skip(prototxt, phase, **kwargs):
    from caffe_syncbn.layer import layer_type_list
    net_param = caffe_pb2.NetParameter()
    from google.protobuf import text_format
    text_format.Parse(open(prototxt).read(), net_param)
    missing = {lp.type for lp in net_param.layer} - set(layer_type_list())
    if missing:
        pytest.skip('layer types not implemented yet: %s' % sorted(missing))
    from caffe_syncbn import Net
    return Net(str(prototxt), phase, **kwargs)


def test_net_loads_v1_weights():
    prototxt = require(GOLDEN / 'format_v1_caffemodel.prototxt')
    net = _net_or_skip(prototxt, caffe_pb2.TEST,
                       weights=str(GOLDEN / 'format_v1_caffemodel.v1.caffemodel'))
    ref = np.load(GOLDEN / 'format_v1_caffemodel.npz')
    out = net.forward(data=ref['input/data'])
    np.testing.assert_allclose(out['prob'], ref['data/prob'], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('suffix', ['.caffemodel', '.caffemodel.h5'])
def test_net_save_and_load(tmp_path, suffix):
    prototxt = require(GOLDEN / 'format_hdf5_caffemodel.prototxt')
    net = _net_or_skip(prototxt, caffe_pb2.TEST,
                       weights=str(GOLDEN / 'format_hdf5_caffemodel.caffemodel'))
    ref = np.load(GOLDEN / 'format_hdf5_caffemodel.npz')
    path = tmp_path / ('saved' + suffix)
    (net.save if suffix == '.caffemodel' else net.save_hdf5)(str(path))
    again = _net_or_skip(prototxt, caffe_pb2.TEST, weights=str(path))
    out = again.forward(data=ref['input/data'])
    np.testing.assert_allclose(out['prob'], ref['data/prob'], rtol=1e-4, atol=1e-5)


def test_opencv_reads_a_saved_caffemodel(tmp_path):
    """OpenCV's independent Caffe importer loads what Net.save() writes."""
    cv2 = pytest.importorskip('cv2')
    prototxt = require(GOLDEN / 'format_hdf5_caffemodel.prototxt')
    net = _net_or_skip(prototxt, caffe_pb2.TEST,
                       weights=str(GOLDEN / 'format_hdf5_caffemodel.caffemodel.h5'))
    net.save(str(tmp_path / 'saved.caffemodel'))
    ref = np.load(GOLDEN / 'format_hdf5_caffemodel.npz')
    cv_net = cv2.dnn.readNetFromCaffe(str(prototxt), str(tmp_path / 'saved.caffemodel'))
    cv_net.setInput(ref['input/data'])
    np.testing.assert_allclose(cv_net.forward('prob'), ref['data/prob'], rtol=1e-4, atol=1e-5)
