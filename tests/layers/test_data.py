"""Input, DummyData, HDF5Data, HDF5Output and the DataLayer feeder contract."""
import h5py
import numpy as np
import pytest
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layer import TEST, TRAIN
from caffe_syncbn.layers.data.layers import DataLayer, HDF5Reader
from caffe_syncbn.testing import build_layer
from helpers.paths import GOLDEN, require


def golden_layer(case, index=0):
    """Layer ``index`` of golden ``case``'s net, its npz, and its phase."""
    net = text_format.Parse(require(GOLDEN / (case + '.prototxt')).read_text(),
                            caffe_pb2.NetParameter())
    ref = np.load(GOLDEN / (case + '.npz'))
    return net.layer[index], ref, TRAIN if str(ref['phase']) == 'TRAIN' else TEST


def write_h5(path, **datasets):
    with h5py.File(path, 'w') as f:
        for name, array in datasets.items():
            f[name] = array


def hdf5_files(folder, rows):
    """Files of ``rows`` rows each whose 'data' rows count up 0, 1, 2, ... across files."""
    names, start = [], 0
    for i, n in enumerate(rows):
        name = 'part%d.h5' % i
        values = np.arange(start, start + n, dtype=np.float32)
        write_h5(folder / name, data=values[:, None] * [1, 10], label=values)
        names.append(name)
        start += n
    (folder / 'list.txt').write_text('\n'.join(names) + '\n')
    return folder / 'list.txt'


def hdf5_layer(source, batch, shuffle=False, seed=0):
    text = ('name: "h5" type: "HDF5Data" top: "data" top: "label" '
            'hdf5_data_param { source: "%s" batch_size: %d shuffle: %s }'
            % (source, batch, 'true' if shuffle else 'false'))
    return build_layer(text, [], TRAIN, dtype=np.float32, seed=seed)


# ---- golden -----------------------------------------------------------------------------
def test_golden_data_hdf5(monkeypatch):
    param, ref, phase = golden_layer('data_hdf5')
    monkeypatch.chdir(GOLDEN)
    layer, bottom, top = build_layer(param, [], phase, dtype=np.float32)
    assert [t.shape for t in top] == [ref['batch/1/data'].shape, ref['batch/1/label'].shape]
    for k in range(1, int(ref['n_forward']) + 1):
        layer.forward(bottom, top)
        for blob, name in zip(top, param.top):
            np.testing.assert_array_equal(blob.data, ref['batch/%d/%s' % (k, name)])


def test_golden_dummy_data_constant():
    param, ref, phase = golden_layer('dummy_data_constant')
    layer, bottom, top = build_layer(param, [], phase, dtype=np.float32)
    for _ in range(2):
        layer.forward(bottom, top)
        for blob, name in zip(top, param.top):
            np.testing.assert_array_equal(blob.data, ref['data/' + name])


def test_hdf5_output_writes_what_caffe_wrote(tmp_path):
    """HDF5Output on the rows of golden part0.h5 writes the same datasets (legacy 4-D)."""
    ref = np.load(require(GOLDEN / 'data_hdf5.npz'))
    data, label = ref['file/0/data'], ref['file/0/label'].reshape(-1)
    path = tmp_path / 'out.h5'
    layer, bottom, top = build_layer(
        'name: "out" type: "HDF5Output" bottom: "data" bottom: "label" '
        'hdf5_output_param { file_name: "%s" }' % path, [data, label], TRAIN, dtype=np.float32)
    layer.forward(bottom, top)
    with h5py.File(path, 'r') as mine, h5py.File(GOLDEN / 'data_hdf5.part0.h5', 'r') as theirs:
        assert sorted(mine) == sorted(theirs) == ['data', 'label']
        for name in ('data', 'label'):
            assert mine[name].dtype == theirs[name].dtype and mine[name].shape == theirs[name].shape
            np.testing.assert_array_equal(mine[name][()], theirs[name][()])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['out.h5']   # no temp file left
    layer.backward(top, [True, True], bottom)        # nothing to do, as in Caffe


def test_hdf5_output_errors(tmp_path):
    text = ('name: "out" type: "HDF5Output" bottom: "a" bottom: "b" '
            'hdf5_output_param { file_name: "%s" }')
    with pytest.raises(CaffeError, match='same number of rows'):
        build_layer(text % (tmp_path / 'x.h5'), [np.zeros((2, 3)), np.zeros(3)])
    with pytest.raises(CaffeError, match='legacy 4-D'):
        build_layer(text % (tmp_path / 'x.h5'), [np.zeros((1, 1, 1, 1, 2)), np.zeros(1)])
    layer, bottom, top = build_layer(text % (tmp_path / 'no' / 'x.h5'), [np.zeros(2), np.zeros(2)])
    with pytest.raises(CaffeError, match='does not exist'):
        layer.forward(bottom, top)


# ---- HDF5Data ---------------------------------------------------------------------------
def test_hdf5_batches_cross_files_and_wrap(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hdf5_files(tmp_path, [3, 1, 4])
    layer, bottom, top = hdf5_layer('list.txt', 5)
    assert [t.shape for t in top] == [(5, 2), (5,)]
    seen = []
    for _ in range(4):
        layer.forward(bottom, top)
        seen += list(top[1].data)
        np.testing.assert_array_equal(top[0].data[:, 1], top[1].data * 10)
    assert seen == [i % 8 for i in range(20)]


def test_hdf5_reader_draws_any_row_count(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hdf5_files(tmp_path, [2, 3])
    reader = HDF5Reader('list.txt', ['label', 'data'], np.float64)
    empty = reader.next_batch(0)
    assert [a.shape for a in empty] == [(0,), (0, 2)] and empty[0].dtype == np.float64
    assert list(reader.next_batch(12)[0]) == [0, 1, 2, 3, 4] * 2 + [0, 1]
    assert list(reader.next_batch(1)[0]) == [2]


def test_hdf5_shuffle_visits_every_row_once_per_epoch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hdf5_files(tmp_path, [4, 3, 5])
    layer, bottom, top = hdf5_layer('list.txt', 12, shuffle=True)
    epochs = []
    for _ in range(3):
        layer.forward(bottom, top)
        epochs.append(list(top[1].data))
        assert sorted(epochs[-1]) == list(range(12))
    assert len({tuple(e) for e in epochs}) > 1 and epochs[0] != list(range(12))
    again, _, top2 = hdf5_layer('list.txt', 12, shuffle=True)
    again.forward([], top2)
    assert list(top2[1].data) == epochs[0]       # the seeded ctx.rng decides the order


def test_hdf5_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CaffeError, match="layer 'h5'.*cannot read the HDF5 file list "
                                         "'missing.txt'"):
        hdf5_layer('missing.txt', 2)
    (tmp_path / 'empty.txt').write_text('\n')
    with pytest.raises(CaffeError, match='names no files'):
        hdf5_layer('empty.txt', 2)
    write_h5(tmp_path / 'a.h5', data=np.zeros((3, 2)), other=np.zeros(3))
    (tmp_path / 'a.txt').write_text('a.h5')
    with pytest.raises(CaffeError,
                       match=r"'a.h5' has no dataset 'label' \(it has: 'data', 'other'\)"):
        hdf5_layer('a.txt', 2)
    write_h5(tmp_path / 'b.h5', data=np.zeros((3, 2)), label=np.zeros(4))
    (tmp_path / 'b.txt').write_text('b.h5')
    with pytest.raises(CaffeError, match='same number'):
        hdf5_layer('b.txt', 2)
    (tmp_path / 'c.txt').write_text('nothere.h5')
    with pytest.raises(CaffeError, match="'nothere.h5', listed in c.txt, does not exist"):
        hdf5_layer('c.txt', 2)
    with pytest.raises(CaffeError, match='batch_size must be > 0'):
        hdf5_layer('a.txt', 0)


# ---- Input and the feeder ---------------------------------------------------------------
def test_input_shapes_and_feeder():
    layer, bottom, top = build_layer(
        'name: "in" type: "Input" top: "a" top: "b" input_param { shape { dim: 4 dim: 3 } }', [])
    assert [t.shape for t in top] == [(4, 3), (4, 3)] and layer.batch_size == 4
    top[0].data[...] = 7
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    assert (top[0].data == 7).all()            # the caller's values stay
    with pytest.raises(CaffeError, match='no reader'):
        layer.make_reader()
    layer.ctx.feeder = lambda l: [np.ones((0, 3)), np.full((2, 5), 2.0)]
    layer.forward(bottom, top)
    assert top[0].shape == (0, 3) and top[1].shape == (2, 5) and (top[1].data == 2).all()
    with pytest.raises(CaffeError, match='1 shape or one per top'):
        build_layer('name: "in" type: "Input" top: "a" top: "b" top: "c" '
                    'input_param { shape { dim: 1 } shape { dim: 2 } }', [])


def test_data_layer_feeder_and_own_reader(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hdf5_files(tmp_path, [6])
    layer, bottom, top = hdf5_layer('list.txt', 4)
    assert isinstance(layer, DataLayer) and layer.batch_size == 4
    # one pipeline reader serves the global batch; each replica gets its slice
    reader = layer.make_reader()
    global_batch = reader.next_batch(2 * layer.batch_size)
    slices = [[a[:5] for a in global_batch], [a[5:] for a in global_batch]]
    for replica_slice in slices:
        layer.ctx.feeder = lambda l, s=replica_slice: s
        layer.forward(bottom, top)
        np.testing.assert_array_equal(top[1].data, replica_slice[1])
        assert top[0].data.dtype == np.float32
    layer.ctx.feeder = lambda l: [np.zeros((0, 2)), np.zeros(0)]
    layer.forward(bottom, top)
    assert top[0].shape == (0, 2)
    layer.ctx.feeder = lambda l: [np.zeros((1, 2))]
    with pytest.raises(CaffeError, match='expected 2 arrays'):
        layer.forward(bottom, top)
    layer.ctx.feeder = None                     # the own reader was not advanced by the feeder
    layer.forward(bottom, top)
    assert list(top[1].data) == [0, 1, 2, 3]


# ---- DummyData --------------------------------------------------------------------------
def test_dummy_data_legacy_shapes_and_shared_filler():
    layer, bottom, top = build_layer(
        'name: "d" type: "DummyData" top: "a" top: "b" dummy_data_param { '
        'data_filler { type: "constant" value: 2 } num: 2 channels: 3 channels: 1 '
        'height: 4 width: 5 }', [])
    layer.forward(bottom, top)
    assert [t.shape for t in top] == [(2, 3, 4, 5), (2, 1, 4, 5)]
    assert (top[0].data == 2).all() and (top[1].data == 2).all()
    layer, bottom, top = build_layer('name: "d" type: "DummyData" top: "a" '
                                     'dummy_data_param { shape { dim: 3 } }', [])
    layer.forward(bottom, top)
    assert (top[0].data == 0).all()


def test_dummy_data_random_fillers_refill_each_forward():
    layer, bottom, top = build_layer(
        'name: "d" type: "DummyData" top: "a" top: "b" dummy_data_param { '
        'data_filler { type: "gaussian" } data_filler { type: "constant" value: 1 } '
        'shape { dim: 50 } }', [])
    layer.forward(bottom, top)
    first = top[0].data.copy()
    layer.forward(bottom, top)
    assert first.std() > 0.5 and not np.array_equal(first, top[0].data)
    assert (top[1].data == 1).all()


@pytest.mark.parametrize('params, message', [
    ('shape { dim: 1 } shape { dim: 2 } shape { dim: 3 }', '1 or 2 shapes'),
    ('shape { dim: 1 } num: 1', 'either shape or the legacy'),
    ('num: 1 num: 2 num: 3 channels: 1 height: 1 width: 1', '1 or 2 values of num'),
    ('shape { dim: 1 } data_filler {} data_filler {} data_filler {}', '0, 1 or 2 data_filler'),
])
def test_dummy_data_errors(params, message):
    with pytest.raises(CaffeError, match=message):
        build_layer('name: "d" type: "DummyData" top: "a" top: "b" dummy_data_param { %s }'
                    % params, [])
