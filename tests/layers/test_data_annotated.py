"""AnnotatedData and convert_annoset against the SSD fork (goldens and LMDBs the fork made
in tests/ssd_golden, see its README.md), and the invariants of the random augmentations."""
import shutil
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2
from caffe_syncbn.data.annotation import (annotation_rows, convert_annoset,
                                          parse_annotated_datum, read_json_boxes)
from caffe_syncbn.data.box_augment import (coverage, expand, generate_samples, jaccard,
                                           meets_emit_constraint, project_boxes, random_crop)
from caffe_syncbn.data.datum import LMDBReader, datum_to_array
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layer import TEST, TRAIN
from caffe_syncbn.testing import build_layer
from helpers.paths import ROOT, SSD_GOLDEN as GOLDEN

ANNOSET = GOLDEN / 'annoset'
CASES = ['annotated_data_xml_center_crop', 'annotated_data_txt_warp']


def layer_param(name, source=None):
    net = text_format.Parse((GOLDEN / (name + '.prototxt')).read_text(), caffe_pb2.NetParameter())
    param = net.layer[0]
    if source is not None:
        param.data_param.source = str(source)
    return param


@pytest.mark.parametrize('name', CASES)
def test_forward_matches_the_fork(name, monkeypatch):
    monkeypatch.chdir(GOLDEN)
    ref = np.load(GOLDEN / (name + '.npz'))
    layer, bottom, top = build_layer(layer_param(name), [], phase=TEST, dtype=np.float32)
    for step in range(2):
        layer.forward(bottom, top)
        # a warp goes through OpenCV's resize: equal up to a rounding of one grey level
        atol = 1.0 if 'warp' in name else 0
        np.testing.assert_allclose(top[0].data, ref['data/%d' % step], atol=atol)
        assert np.mean(top[0].data != ref['data/%d' % step]) < 0.02
        np.testing.assert_allclose(top[1].data, ref['label/%d' % step], rtol=1e-6, atol=1e-7)


def records(path):
    return list(LMDBReader(str(path)).records())


@pytest.mark.parametrize('label_type, lmdb, options', [
    ('xml', 'fork_xml_lmdb', {}),
    ('txt', 'fork_txt_lmdb', {'encoded': True, 'encode_type': 'png'}),
])
def test_convert_annoset_writes_the_forks_records(tmp_path, label_type, lmdb, options):
    ours = tmp_path / 'ours'
    count = convert_annoset(str(ANNOSET) + '/', str(ANNOSET / (label_type + '_list.txt')),
                            str(ours), str(ANNOSET / 'labelmap.prototxt'), label_type,
                            log=lambda *a: None, **options)
    fork = records(ANNOSET / lmdb)
    mine = records(ours)
    assert count == len(fork) == len(mine)
    for (fork_key, fork_value), (key, value) in zip(fork, mine):
        assert key == fork_key
        a, b = parse_annotated_datum(fork_value), parse_annotated_datum(value)
        np.testing.assert_array_equal(annotation_rows(b), annotation_rows(a))
        np.testing.assert_array_equal(datum_to_array(b.datum), datum_to_array(a.datum))
        assert (b.type, b.datum.label) == (a.type, a.datum.label)
        if not a.datum.encoded:          # raw pixels: the very same bytes
            assert value == fork_value


@pytest.mark.parametrize('name', CASES)
def test_forward_on_our_lmdb_matches_the_fork(name, tmp_path, monkeypatch):
    label_type = 'xml' if 'xml' in name else 'txt'
    options = {} if label_type == 'xml' else {'encoded': True, 'encode_type': 'png'}
    convert_annoset(str(ANNOSET) + '/', str(ANNOSET / (label_type + '_list.txt')),
                    str(tmp_path / 'db'), str(ANNOSET / 'labelmap.prototxt'), label_type,
                    log=lambda *a: None, **options)
    monkeypatch.chdir(GOLDEN)
    ref = np.load(GOLDEN / (name + '.npz'))
    layer, bottom, top = build_layer(layer_param(name, tmp_path / 'db'), [], phase=TEST,
                                     dtype=np.float32)
    layer.forward(bottom, top)
    np.testing.assert_allclose(top[1].data, ref['label/0'], rtol=1e-6, atol=1e-7)


def test_replicas_number_their_images_from_zero(monkeypatch):
    monkeypatch.chdir(GOLDEN)
    param = layer_param(CASES[0])
    layer, _, _ = build_layer(param, [], phase=TEST, dtype=np.float32)
    whole = layer.make_reader().next_batch(4)[1].reshape(-1, 8)
    parts = layer.make_reader().next_batches([2, 2])
    for first, (_, labels) in zip((0, 2), parts):
        rows = labels.reshape(-1, 8)
        expected = whole[(whole[:, 0] >= first) & (whole[:, 0] < first + 2)].copy()
        expected[:, 0] -= first
        np.testing.assert_array_equal(rows, expected)


def augmented_layer(tmp_path, monkeypatch, transform, samplers=''):
    monkeypatch.chdir(GOLDEN)
    text = ('name: "data" type: "AnnotatedData" top: "data" top: "label" '
            'transform_param { %s } data_param { source: "annoset/fork_xml_lmdb" '
            'batch_size: 4 backend: LMDB } annotated_data_param { %s }' % (transform, samplers))
    return build_layer(text, [], phase=TRAIN, dtype=np.float64)[0]


SSD_SAMPLERS = ''.join(
    'batch_sampler { sampler { min_scale: 0.3 max_scale: 1.0 min_aspect_ratio: 0.5 '
    'max_aspect_ratio: 2.0 } sample_constraint { min_jaccard_overlap: %g } max_sample: 1 '
    'max_trials: 50 } ' % overlap for overlap in (0.1, 0.5, 0.9))


def test_sampled_crops_keep_their_constraints_and_boxes_follow(tmp_path, monkeypatch):
    layer = augmented_layer(tmp_path, monkeypatch,
                            'resize_param { resize_mode: WARP height: 30 width: 30 } '
                            'emit_constraint { emit_type: CENTER }', SSD_SAMPLERS)
    image, rows = layer.decode(*next(iter(LMDBReader(str(ANNOSET / 'fork_xml_lmdb')).records())))
    rng = np.random.RandomState(0)
    for _ in range(20):
        samples = generate_samples(rows, layer.samplers, rng)
        for sample in samples:      # each sampler's crop overlaps some object enough
            assert any(jaccard(sample, row[2:6]) >= 0.1 for row in rows)
        crop_image, crop_rows = random_crop(image, rows, layer.samplers, rng, layer.emit)
        assert np.all((crop_rows[:, 2:6] >= 0) & (crop_rows[:, 2:6] <= 1))
        assert np.all(crop_rows[:, 4] > crop_rows[:, 2]) and np.all(crop_rows[:, 5] > crop_rows[:, 3])
        assert set(map(tuple, crop_rows[:, :2])) <= set(map(tuple, rows[:, :2]))
    reader = layer.make_reader(np.random.RandomState(1))
    data, labels = reader.next_batch(4)
    assert data.shape == (4, 3, 30, 30)
    assert np.all((labels[0, 0, :, 3:7] >= 0) & (labels[0, 0, :, 3:7] <= 1))


def test_projection_follows_the_crop_and_the_emit_constraint_drops_boxes():
    rows = np.array([[1, 0, 0.1, 0.4, 0.3, 0.6, 0],      # centre outside the crop
                     [2, 0, 0.4, 0.4, 0.8, 0.8, 1],      # centre inside
                     [3, 0, 0.45, 0.15, 0.7, 0.65, 0]])  # centre inside, 60% covered
    crop = np.array([0.25, 0.35, 0.75, 0.85])
    center = caffe_pb2.EmitConstraint(emit_type=caffe_pb2.EmitConstraint.CENTER)
    kept = project_boxes(rows, crop, center)
    assert kept[:, 0].tolist() == [2, 3]
    np.testing.assert_allclose(kept[0, 2:6], [0.3, 0.1, 1.0, 0.9], rtol=1e-6)
    np.testing.assert_allclose(kept[1, 2:6], [0.4, 0.0, 0.9, 0.6], rtol=1e-6)
    assert kept[0, 6] == 1
    overlap = caffe_pb2.EmitConstraint(emit_type=caffe_pb2.EmitConstraint.MIN_OVERLAP,
                                       emit_overlap=0.7)
    assert project_boxes(rows, crop, overlap)[:, 0].tolist() == [2]
    assert coverage(rows[2, 2:6], crop) == pytest.approx(0.6)
    assert not meets_emit_constraint(crop, rows[0, 2:6], center)
    assert project_boxes(rows, crop)[:, 0].tolist() == [1, 2, 3]


def test_expand_and_distort_keep_boxes_on_the_image(tmp_path, monkeypatch):
    layer = augmented_layer(tmp_path, monkeypatch,
                            'mirror: true mean_value: 104 mean_value: 117 mean_value: 123 '
                            'resize_param { resize_mode: WARP height: 32 width: 32 } '
                            'expand_param { prob: 1 max_expand_ratio: 3 } '
                            'distort_param { brightness_prob: 1 brightness_delta: 32 '
                            'contrast_prob: 1 contrast_lower: 0.5 contrast_upper: 1.5 '
                            'hue_prob: 1 hue_delta: 18 saturation_prob: 1 saturation_lower: 0.5 '
                            'saturation_upper: 1.5 }')
    image, rows = layer.decode(*next(iter(LMDBReader(str(ANNOSET / 'fork_xml_lmdb')).records())))
    canvas, moved = expand(image, rows, layer.transform.expand_param, layer.mean_values,
                           np.random.RandomState(4))
    assert canvas.shape[0] >= image.shape[0] and canvas.shape[1] >= image.shape[1]
    # boxes inside the image keep their pixels: one whole-pixel shift for all of them
    inside = np.all((rows[:, 2:6] >= 0) & (rows[:, 2:6] <= 1), axis=1)
    assert inside.sum() >= 2 and len(moved) == len(rows)
    canvas_size = np.array([canvas.shape[1], canvas.shape[0]] * 2)
    image_size = np.array([image.shape[1], image.shape[0]] * 2)
    shift = moved[inside, 2:6] * canvas_size - rows[inside, 2:6] * image_size
    np.testing.assert_allclose(shift, np.broadcast_to(np.round(shift[0]), shift.shape), atol=1e-3)
    data, labels = layer.make_reader(np.random.RandomState(2)).next_batch(4)
    assert data.shape == (4, 3, 32, 32) and np.all(np.isfinite(data))


def test_json_annotations_map_category_names(tmp_path):
    path = tmp_path / 'a.json'
    path.write_text('{"image": {"height": 20, "width": 40}, "annotation": '
                    '[{"bbox": [4, 2, 10, 8], "category_id": "cat", "iscrowd": 1}]}')
    ((label, box, crowd),) = read_json_boxes(str(path), 0, 0, {'cat': 3})
    assert (label, crowd) == (3, True)
    assert box == pytest.approx((0.1, 0.1, 0.35, 0.5), rel=1e-7)
    with pytest.raises(CaffeError, match='category_id .cat. is not in the label map'):
        read_json_boxes(str(path), 0, 0, {'dog ': 1})


def test_bad_input_is_one_clear_error(tmp_path, monkeypatch):
    shutil.copytree(ANNOSET, tmp_path / 'annoset')
    (tmp_path / 'annoset' / 'voc_0.xml').write_text(
        '<annotation><object><name>dog</name><bndbox><xmin>1</xmin></bndbox></object></annotation>')
    with pytest.raises(CaffeError, match='object name .dog. is not in the label map'):
        convert_annoset(str(tmp_path / 'annoset') + '/', str(tmp_path / 'annoset' / 'xml_list.txt'),
                        str(tmp_path / 'db'), str(tmp_path / 'annoset' / 'labelmap.prototxt'),
                        log=lambda *a: None)
    monkeypatch.chdir(GOLDEN)
    with pytest.raises(CaffeError, match="layer 'data'.*resize_mode FIT_SMALL_SIZE is not"):
        build_layer('name: "data" type: "AnnotatedData" top: "data" transform_param { '
                    'resize_param { resize_mode: FIT_SMALL_SIZE height: 3 width: 3 } } '
                    'data_param { source: "annoset/fork_xml_lmdb" batch_size: 1 backend: LMDB }', [])


def test_the_tool_writes_what_the_function_writes(tmp_path):
    tool = ROOT / 'tools' / 'convert_annoset.py'
    result = subprocess.run([sys.executable, str(tool), '--label_type', 'txt',
                             '--label_map_file', str(ANNOSET / 'labelmap.prototxt'),
                             str(ANNOSET) + '/', str(ANNOSET / 'txt_list.txt'),
                             str(tmp_path / 'db')], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    fork = records(ANNOSET / 'fork_txt_lmdb')
    mine = records(tmp_path / 'db')
    assert [k for k, _ in mine] == [k for k, _ in fork]
    for (_, a), (_, b) in zip(fork, mine):
        np.testing.assert_array_equal(annotation_rows(parse_annotated_datum(b)),
                                      annotation_rows(parse_annotated_datum(a)))
    bad = subprocess.run([sys.executable, str(tool), '--anno_type', 'classification',
                          str(ANNOSET) + '/', str(ANNOSET / 'txt_list.txt'),
                          str(tmp_path / 'db2')], capture_output=True, text=True)
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1].count('--anno_type classification') == 1
