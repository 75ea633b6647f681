"""Image data: Datum/LMDB, the DataTransformer, the Data/ImageData/MemoryData/SegData layers,
convert_imageset and compute_image_mean. The segmentation demo's tests are in test_demo.py."""
import sys

import numpy as np
import pytest
from helpers import watchdog
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layer import TEST, TRAIN
from caffe_syncbn.testing import build_layer

from helpers.paths import GOLDEN, ROOT, require

cv2 = pytest.importorskip('cv2')

from caffe_syncbn.data import (DataTransformer, LMDBReader, compute_image_mean,  # noqa: E402
                               convert_imageset, datum_to_array, parse_datum)
from caffe_syncbn.formats.blobs import read_blob_proto  # noqa: E402

LMDB_CASES = ['data_lmdb_test_center_crop', 'data_lmdb_train_no_mirror']


def forward(layer, top):
    layer.forward([], top)
    return [t.data.copy() for t in top]


# ---- golden: Caffe's own Data layer on Caffe's own LMDB ---------------------------------
@pytest.mark.parametrize('case', LMDB_CASES)
def test_data_layer_golden_batches(case, monkeypatch):
    require(GOLDEN / (case + '.npz'))
    monkeypatch.chdir(GOLDEN)
    ref = np.load(GOLDEN / (case + '.npz'))
    net = text_format.Parse((GOLDEN / (case + '.prototxt')).read_text(), caffe_pb2.NetParameter())
    phase = TRAIN if str(ref['phase']) == 'TRAIN' else TEST
    layer, _, top = build_layer(net.layer[0], [], phase=phase, dtype=np.float32)
    assert top[0].shape == ref['batch/1/data'].shape
    for k in range(1, int(ref['n_forward']) + 1):
        data, label = forward(layer, top)
        np.testing.assert_array_equal(data, ref['batch/%d/data' % k])
        np.testing.assert_array_equal(label, ref['batch/%d/label' % k])
    reader = LMDBReader(net.layer[0].data_param.source)
    for i, (key, value) in enumerate(reader.next_records(reader.size)):
        datum = parse_datum(value)
        assert key == b'%08d' % i
        np.testing.assert_array_equal(datum_to_array(datum), ref['datum/%d/data' % i])
        assert datum.label == ref['datum/%d/label' % i]


def data_layer(source, batch_size=2, phase=TEST, transform='', tops=('data', 'label')):
    text = ('name: "data" type: "Data" %s transform_param { %s } '
            'data_param { source: "%s" batch_size: %d backend: LMDB }'
            % (' '.join('top: "%s"' % t for t in tops), transform, source, batch_size))
    layer, _, top = build_layer(text, [], phase=phase, dtype=np.float32)
    return layer, top


def test_missing_lmdb_and_leveldb_are_clear_errors(tmp_path):
    with pytest.raises(CaffeError, match="layer 'data'.*%s.*not found" % tmp_path.name):
        data_layer(str(tmp_path / 'nope'))
    text = 'name: "d" type: "Data" top: "x" data_param { source: "x" batch_size: 1 }'
    with pytest.raises(CaffeError, match='LEVELDB is not supported'):
        build_layer(text, [])


# ---- convert_imageset / compute_image_mean ------------------------------------------------
@pytest.fixture(scope='module')
def image_set(tmp_path_factory):
    """Five 7x9 colour PNGs in root/sub/ and a list file naming them with labels."""
    root = tmp_path_factory.mktemp('images')
    (root / 'sub').mkdir()
    rng = np.random.RandomState(3)
    images, lines = [], []
    for i in range(5):
        image = rng.randint(0, 256, (7, 9, 3)).astype(np.uint8)
        name = 'sub/img %d.png' % i               # a space in the name, as Caffe allows
        cv2.imwrite(str(root / name), image)
        images.append(image.transpose(2, 0, 1))
        lines.append('%s %d\n' % (name, 10 + i))
    (root / 'list.txt').write_text(''.join(lines))
    return root, np.stack(images), np.arange(10, 15)


def convert(image_set, tmp_path, name='db', **options):
    root, _, _ = image_set
    db = str(tmp_path / name)
    count = convert_imageset(str(root) + '/', str(root / 'list.txt'), db, log=lambda *a: None,
                             **options)
    assert count == 5
    return db


@pytest.mark.parametrize('encoded', [False, True])
def test_convert_imageset_round_trip(image_set, tmp_path, encoded):
    root, images, labels = image_set
    db = convert(image_set, tmp_path, encoded=encoded)
    records = LMDBReader(db).next_records(5)
    assert [k for k, _ in records] == [b'%08d_sub/img %d.png' % (i, i) for i in range(5)]
    for i, (_, value) in enumerate(records):
        datum = parse_datum(value)
        assert datum.encoded == encoded and datum.label == labels[i]
        if encoded:           # an unresized PNG is stored as the file's own bytes
            assert datum.data == (root / ('sub/img %d.png' % i)).read_bytes()
        np.testing.assert_array_equal(datum_to_array(datum), images[i])
    layer, top = data_layer(db, batch_size=3)
    for start in (0, 3):                  # the second batch wraps around to the first record
        data, label = forward(layer, top)
        rows = [(start + j) % 5 for j in range(3)]
        np.testing.assert_array_equal(data, images[rows].astype(np.float32))
        np.testing.assert_array_equal(label, labels[rows])


def test_convert_imageset_options(image_set, tmp_path):
    root, images, _ = image_set
    gray = LMDBReader(convert(image_set, tmp_path, 'gray', gray=True, resize_height=4,
                              resize_width=5))
    datum = parse_datum(gray.first()[1])
    image = cv2.imread(str(root / 'sub/img 0.png'), cv2.IMREAD_GRAYSCALE)
    np.testing.assert_array_equal(datum_to_array(datum)[0], cv2.resize(image, (5, 4)))
    jpeg = LMDBReader(convert(image_set, tmp_path, 'jpeg', encoded=True, encode_type='jpg'))
    payload = parse_datum(jpeg.first()[1]).data
    assert payload[:2] == b'\xff\xd8'       # re-encoded as JPEG
    shuffled = LMDBReader(convert(image_set, tmp_path, 'shuffled', shuffle=True))
    keys = [k for k, _ in shuffled.next_records(5)]
    assert sorted(k.split(b'_', 1)[1] for k in keys) == [b'sub/img %d.png' % i for i in range(5)]
    with pytest.raises(CaffeError, match='already exists'):
        convert(image_set, tmp_path, 'gray')


def test_compute_image_mean_and_mean_file(image_set, tmp_path):
    _, images, _ = image_set
    db = convert(image_set, tmp_path)
    mean_path = str(tmp_path / 'mean.binaryproto')
    mean = compute_image_mean(db, mean_path, log=lambda *a: None)
    np.testing.assert_allclose(mean, images.mean(axis=0), rtol=1e-6)
    stored = read_blob_proto(mean_path)
    assert stored.shape == (1, 3, 7, 9)              # Caffe's legacy 4-D mean blob
    layer, top = data_layer(db, batch_size=5, transform='mean_file: "%s" scale: 0.5 crop_size: 5'
                            % mean_path)
    data, _ = forward(layer, top)
    expected = (images[:, :, 1:6, 2:7].astype(np.float32) - stored[0][:, 1:6, 2:7]) * 0.5
    np.testing.assert_allclose(data, expected, rtol=1e-6, atol=1e-6)


def run_tool(name, *args):
    return watchdog.run([sys.executable, str(ROOT / 'tools' / name)] + [str(a) for a in args],
                        capture_output=True, text=True, limit=60)


def test_tools_command_line(image_set, tmp_path):
    root, images, _ = image_set
    done = run_tool('convert_imageset.py', str(root) + '/', root / 'list.txt', tmp_path / 'db')
    assert done.returncode == 0, done.stderr
    assert 'Processed 5 files.' in done.stderr
    done = run_tool('compute_image_mean.py', tmp_path / 'db', tmp_path / 'mean.binaryproto')
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(read_blob_proto(str(tmp_path / 'mean.binaryproto'))[0],
                               images.mean(axis=0), rtol=1e-6)
    for tool, args in (('convert_imageset.py', (root, tmp_path / 'missing.txt', tmp_path / 'x')),
                       ('compute_image_mean.py', (tmp_path / 'no_db',))):
        done = run_tool(tool, *args)
        assert done.returncode == 1
        assert 'Traceback' not in done.stderr
        assert done.stderr.strip().count('\n') == 0 and 'error:' in done.stderr


# ---- DataTransformer ------------------------------------------------------------------------
def transformer(phase, seed=0, **fields):
    param = caffe_pb2.TransformationParameter(**fields)
    return DataTransformer(param, phase, np.random.RandomState(seed))


def test_transform_test_phase_matches_hand_computation():
    x = np.arange(2 * 3 * 5 * 6, dtype=np.uint8).reshape(2, 3, 5, 6)
    out = transformer(TEST, crop_size=3, mean_value=[1, 2, 3], scale=0.5)(x)
    expected = (x[:, :, 1:4, 1:4].astype(np.float32) - np.float32([1, 2, 3])[:, None, None]) * 0.5
    np.testing.assert_array_equal(out, expected)
    one_mean = transformer(TEST, mean_value=[4])(x, np.float64)
    assert one_mean.dtype == np.float64
    np.testing.assert_array_equal(one_mean, x - 4.0)
    with pytest.raises(CaffeError, match='1 mean_value or one per channel'):
        transformer(TEST, mean_value=[1, 2])(x)
    with pytest.raises(CaffeError, match='crop_size 6 is larger'):
        transformer(TEST, crop_size=6)(x)


def test_transform_train_crops_and_mirrors_each_image_on_its_own():
    rng = np.random.RandomState(0)
    x = rng.randint(0, 256, (40, 2, 6, 7)).astype(np.uint8)
    out = transformer(TRAIN, seed=5, crop_size=4, mirror=True)(x)
    seen_flip, offsets = set(), set()
    for image, result in zip(x, out):
        matches = [(t, l, f) for t in range(3) for l in range(4) for f in (False, True)
                   if np.array_equal(result, (image[:, t:t + 4, l:l + 4][..., ::-1] if f else
                                              image[:, t:t + 4, l:l + 4]))]
        assert matches, 'output is not a (flipped) crop of its input'
        seen_flip.add(matches[0][2])
        offsets.add(matches[0][:2])
    assert seen_flip == {False, True} and len(offsets) > 4
    again = transformer(TRAIN, seed=5, crop_size=4, mirror=True)(x)
    np.testing.assert_array_equal(out, again)        # the reader's seed fixes the draws


def test_transform_mixed_sizes_need_crop():
    images = [np.full((1, 4, 4), 1, np.uint8), np.full((1, 5, 6), 2, np.uint8)]
    out = transformer(TEST, crop_size=3)(images)
    assert out.shape == (2, 1, 3, 3) and (out[0] == 1).all() and (out[1] == 2).all()
    with pytest.raises(CaffeError, match='need crop_size'):
        transformer(TEST)(images)


# ---- ImageData and MemoryData ----------------------------------------------------------------
def test_image_data_layer(image_set):
    root, images, labels = image_set
    text = ('name: "img" type: "ImageData" top: "data" top: "label" '
            'image_data_param { source: "%s" root_folder: "%s/" batch_size: 3 %s }')
    layer, _, top = build_layer(text % (root / 'list.txt', root, ''), [], phase=TEST)
    first, second = forward(layer, top), forward(layer, top)
    np.testing.assert_array_equal(first[0], images[:3])
    np.testing.assert_array_equal(second[1], labels[[3, 4, 0]])
    layer, _, top = build_layer(text % (root / 'list.txt', root,
                                        'shuffle: true is_color: false new_height: 3 '
                                        'new_width: 4'), [], phase=TRAIN)
    assert top[0].shape == (3, 1, 3, 4)
    seen = np.concatenate([forward(layer, top)[1] for _ in range(5)])
    assert sorted(seen[:5]) == list(labels) and sorted(seen[5:10]) == list(labels)


def test_memory_data_layer():
    text = ('name: "mem" type: "MemoryData" top: "data" top: "label" '
            'memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 }')
    layer, _, top = build_layer(text, [], phase=TEST)
    assert top[0].shape == (2, 1, 2, 3)
    with pytest.raises(CaffeError, match='set_input_arrays'):
        forward(layer, top)
    data = np.arange(24, dtype=np.float32).reshape(4, 1, 2, 3)
    layer.set_input_arrays(data, np.arange(4).reshape(4, 1, 1, 1))
    batches = [forward(layer, top) for _ in range(3)]
    np.testing.assert_array_equal(batches[1][0], data[2:])
    np.testing.assert_array_equal(batches[2][1], [0, 1])
    layer.set_input_arrays(data[:2] + 100, np.array([7, 8]))
    np.testing.assert_array_equal(forward(layer, top)[1], [7, 8])
    with pytest.raises(CaffeError, match='multiple of batch_size'):
        layer.set_input_arrays(data[:3], np.zeros(3))
    with pytest.raises(CaffeError, match='data must be N x 1 x 2 x 3'):
        layer.set_input_arrays(np.zeros((2, 3, 2, 3)), np.zeros(2))


# ---- SegData ---------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def seg_pair(tmp_path_factory):
    """One 10x12 image whose channel 0 is 10 x its label map (labels 0..3), as jpg-free PNGs."""
    root = tmp_path_factory.mktemp('seg')
    labels = (np.arange(10)[:, None] // 3 + np.arange(12)[None, :] // 4) % 4
    labels = labels.astype(np.uint8)
    image = np.stack([labels * 10, np.full_like(labels, 50), np.full_like(labels, 90)], axis=2)
    cv2.imwrite(str(root / 'a.png'), image)
    cv2.imwrite(str(root / 'a_label.png'), labels)
    (root / 'list.txt').write_text('a.png a_label.png\n')
    return root, image, labels


def seg_layer(root, phase, transform, batch=2):
    text = ('name: "seg" type: "SegData" top: "data" top: "label" '
            'seg_data_param { source: "%s" root_dir: "%s/" } image_data_param { batch_size: %d }'
            ' transform_param { %s }' % (root / 'list.txt', root, batch, transform))
    layer, _, top = build_layer(text, [], phase=phase, dtype=np.float32)
    return layer, top


def test_seg_data_test_pads_with_mean_and_ignore_label(seg_pair):
    root, image, labels = seg_pair
    layer, top = seg_layer(root, TEST, 'crop_size: 14 mean_value: [5, 50, 80] scale: 0.5')
    data, label = forward(layer, top)
    assert data.shape == (2, 3, 14, 14) and label.shape == (2, 1, 14, 14)
    expected = (image.transpose(2, 0, 1) - np.float32([5, 50, 80])[:, None, None]) * 0.5
    np.testing.assert_array_equal(data[0, :, :10, :12], expected)
    assert (data[:, :, 10:] == 0).all() and (data[:, :, :, 12:] == 0).all()
    np.testing.assert_array_equal(label[0, 0, :10, :12], labels)
    assert (label[:, :, 10:] == 255).all() and (label[:, :, :, 12:] == 255).all()
    layer, top = seg_layer(root, TEST, 'crop_size: 6')
    np.testing.assert_array_equal(forward(layer, top)[1][0, 0], labels[2:8, 3:9])   # centred


def test_seg_data_train_keeps_image_and_labels_aligned(seg_pair):
    root, _, _ = seg_pair
    layer, top = seg_layer(root, TRAIN, 'crop_size: 8 mirror: true scale_ratios: 0.6 '
                                        'scale_ratios: 1.4', batch=16)
    data, label = forward(layer, top)
    valid = label != 255
    assert valid.mean() > 0.5 and set(np.unique(label[valid])) <= {0, 1, 2, 3}
    # channel 0 is 10 x label wherever the bilinear resize did not blend two regions; far
    # more often so than with the labels flipped (as a misaligned mirror would leave them)
    agree = (np.abs(data[:, :1] - 10 * label) < 1e-3)[valid].mean()
    flipped = (np.abs(data[:, :1] - 10 * label[..., ::-1]) < 1e-3)[valid[..., ::-1]].mean()
    assert agree > 0.5 and agree > flipped + 0.2, (agree, flipped)
    padded = ~valid
    assert (data[:, :1][padded] == 0).all()
    layer, top = seg_layer(root, TRAIN, 'crop_size: 8 mirror: true', batch=16)
    data, label = forward(layer, top)      # no rescaling: exact everywhere
    np.testing.assert_array_equal(data[:, 0], 10 * label[:, 0])
    assert len({label[i].tobytes() for i in range(16)}) > 3


def test_seg_data_whole_images_and_data_dim(seg_pair):
    root, _, labels = seg_pair
    text = ('name: "seg" type: "ImageSegData" top: "data" top: "label" top: "dim" '
            'image_data_param { source: "%s" root_folder: "%s/" batch_size: 1 }'
            % (root / 'list.txt', root))
    layer, _, top = build_layer(text, [], phase=TEST, dtype=np.float32)
    data, label, dim = forward(layer, top)
    assert data.shape == (1, 3, 10, 12)
    np.testing.assert_array_equal(label[0, 0], labels)
    np.testing.assert_array_equal(dim.ravel(), [10, 12])


# ---- the pipeline contract ------------------------------------------------------------------
def test_one_reader_serves_the_global_batch(image_set, tmp_path):
    from caffe_syncbn.training.input_pipeline import InputPipeline
    _, images, labels = image_set
    db = convert(image_set, tmp_path)
    layer, top = data_layer(db, batch_size=2)
    pipeline = InputPipeline([layer], replicas=2)
    try:
        parts = pipeline.next_split()
    finally:
        pipeline.close()
    np.testing.assert_array_equal(parts[1]['data'][0], images[2:4])
    np.testing.assert_array_equal(parts[0]['data'][1], labels[:2])
    alone, top = data_layer(db, batch_size=4)        # prefetching does not change the order
    for start in (0, 4, 3):
        np.testing.assert_array_equal(forward(alone, top)[1], labels[[(start + j) % 5
                                                                      for j in range(4)]])

