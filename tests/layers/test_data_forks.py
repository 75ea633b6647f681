"""The segmentation forks' data and output layers: SegNet's and ENet's DenseImageData,
DeepLab's ImageSegData (label_type, ignore_label, scale_factors, crop_height/crop_width,
new_height/new_width), and DeepLab's MatWrite and MatRead, whose files scipy reads. The
expected windows are cut with OpenCV and numpy here, as the forks' sources cut them."""
import numpy as np
import pytest
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2
from caffe_syncbn.data.top_shapes import data_top_shapes
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.export import to_onnx
from caffe_syncbn.layer import TEST, TRAIN
from caffe_syncbn.netparam.inputs import swap_data_layers_for_inputs
from caffe_syncbn.testing import build_layer

cv2 = pytest.importorskip('cv2')
scipy_io = pytest.importorskip('scipy.io')

MEAN = np.float32([5, 50, 80])


@pytest.fixture(scope='module')
def pairs(tmp_path_factory):
    """Three 10 x 12 images whose channel 0 is 10 x their label image (labels 0..4)."""
    root = tmp_path_factory.mktemp('pairs')
    rs = np.random.RandomState(0)
    images, labels = [], []
    for i in range(3):
        label = rs.randint(0, 5, (10, 12)).astype(np.uint8)
        image = np.stack([label * 10, rs.randint(0, 255, (10, 12)),
                          rs.randint(0, 255, (10, 12))], axis=2).astype(np.uint8)
        cv2.imwrite(str(root / ('i%d.png' % i)), image)
        cv2.imwrite(str(root / ('l%d.png' % i)), label)
        images.append(image)
        labels.append(label)
    (root / 'pairs.txt').write_text(''.join('i%d.png l%d.png\n' % (i, i) for i in range(3)))
    (root / 'images.txt').write_text(''.join('i%d.png\n' % i for i in range(3)))
    (root / 'classes.txt').write_text(''.join('i%d.png %d\n' % (i, 2 * i) for i in range(3)))
    return root, images, labels


def forward(layer, top, times=1):
    for _ in range(times):
        layer.forward([], top)
    return [t.data.copy() for t in top]


# ---- DenseImageData ---------------------------------------------------------------------------
def dense(root, phase=TEST, param='', transform='', batch=3):
    text = ('name: "data" type: "DenseImageData" top: "data" top: "label" '
            'dense_image_data_param { source: "%s" root_folder: "%s/" batch_size: %d %s } '
            'transform_param { %s }' % (root / 'pairs.txt', root, batch, param, transform))
    layer, _, top = build_layer(text, [], phase=phase, dtype=np.float32)
    return layer, top


def test_dense_image_data_reads_pairs_in_list_order(pairs):
    root, images, labels = pairs
    layer, top = dense(root, transform='mean_value: 5 mean_value: 50 mean_value: 80 scale: 0.5')
    data, label = forward(layer, top)
    assert data.shape == (3, 3, 10, 12) and label.shape == (3, 1, 10, 12)
    for i in range(3):
        np.testing.assert_array_equal(
            data[i], (images[i].transpose(2, 0, 1) - MEAN[:, None, None]) * np.float32(0.5))
        np.testing.assert_array_equal(label[i, 0], labels[i])


def test_dense_image_data_resizes_labels_by_nearest_neighbour_and_enets_factor(pairs):
    root, images, labels = pairs
    layer, top = dense(root, param='new_height: 8 new_width: 6 label_divide_factor: 2')
    data, label = forward(layer, top)
    assert data.shape == (3, 3, 8, 6) and label.shape == (3, 1, 4, 3)
    np.testing.assert_array_equal(data[1], cv2.resize(images[1], (6, 8)).transpose(2, 0, 1))
    np.testing.assert_array_equal(
        label[1, 0], cv2.resize(labels[1], (3, 4), interpolation=cv2.INTER_NEAREST))
    shapes = {top: tuple(s.dim) for top, s in zip(
        ('data', 'label'), swap_data_layers_for_inputs(caffe_pb2.NetParameter(
            layer=[layer.param])).layer[0].input_param.shape)}
    assert shapes == {'data': (3, 3, 8, 6), 'label': (3, 1, 4, 3)}
    assert data_top_shapes(layer.param) == [(3, 3, 8, 6), (3, 1, 4, 3)]


@pytest.mark.parametrize('phase', [TRAIN, TEST], ids=['TRAIN', 'TEST'])
def test_dense_image_data_crops_and_flips_pairs_alike_in_every_phase(pairs, phase):
    """The forks draw their own mirror and crop_height x crop_width window in TEST too."""
    root, images, labels = pairs
    layer, top = dense(root, phase, 'mirror: true crop_height: 6 crop_width: 7', batch=12)
    data, label = forward(layer, top)
    assert data.shape == (12, 3, 6, 7)
    np.testing.assert_array_equal(data[:, 0], 10 * label[:, 0])
    windows = set()
    for i in range(12):
        image = images[i % 3]
        for flip in (False, True):
            source = image[:, ::-1] if flip else image
            for t in range(5):
                for left in range(6):
                    if np.array_equal(source[t:t + 6, left:left + 7].transpose(2, 0, 1), data[i]):
                        windows.add((flip, t, left))
    assert len(windows) > 4 and {flip for flip, _, _ in windows} == {False, True}


def test_dense_image_data_gives_the_label_transform_params_window(pairs):
    """transform_param's crop and flip cut the label as they cut the image (the forks draw
    them again for the label, which misaligns the two)."""
    root, _, _ = pairs
    layer, top = dense(root, TRAIN, transform='crop_size: 5 mirror: true', batch=12)
    data, label = forward(layer, top)
    assert data.shape == (12, 3, 5, 5) and label.shape == (12, 1, 5, 5)
    np.testing.assert_array_equal(data[:, 0], 10 * label[:, 0])
    assert len({data[i].tobytes() for i in range(12)}) > 6


@pytest.mark.parametrize('param, message', [
    ('new_height: 8', 'give both new_height and new_width, or neither'),
    ('label_divide_factor: 2', 'label_divide_factor 2 needs new_height and new_width'),
    ('crop_height: 11 crop_width: 3', 'crop 11 x 3 is larger than an image of 10 x 12'),
    ('new_height: 8 new_width: 8 label_divide_factor: 2 crop_height: 2 crop_width: 2',
     'crop_height and crop_width cut the image and its label alike'),
])
def test_dense_image_data_refuses_what_the_forks_cannot_run(pairs, param, message):
    root, _, _ = pairs
    with pytest.raises(CaffeError, match=message):
        layer, top = dense(root, param=param)
        forward(layer, top)


def test_dense_image_data_refuses_a_label_image_of_another_size(pairs, tmp_path):
    _, images, _ = pairs
    cv2.imwrite(str(tmp_path / 'i0.png'), images[0])
    cv2.imwrite(str(tmp_path / 'small.png'), np.zeros((4, 4), np.uint8))
    (tmp_path / 'pairs.txt').write_text('i0.png small.png\n')
    # a long path is quoted shortened, with its length: the names may not show whole
    with pytest.raises(CaffeError, match=r"image '.*' is 10 x 12 but its label image "
                                         r"'.*' is 4 x 4"):
        dense(tmp_path)


# ---- DeepLab's ImageSegData -------------------------------------------------------------------
def seg(root, listing='pairs.txt', phase=TEST, image='', transform='', batch=3, tops=3):
    text = ('name: "data" type: "ImageSegData" top: "data" top: "label" %s '
            'image_data_param { source: "%s" root_folder: "%s/" batch_size: %d %s } '
            'transform_param { %s }' % ('top: "dim"' if tops == 3 else '', root / listing, root,
                                        batch, image, transform))
    layer, _, top = build_layer(text, [], phase=phase, dtype=np.float32)
    return layer, top


@pytest.mark.parametrize('listing, image, want', [
    ('images.txt', 'label_type: NONE ignore_label: 7', lambda i, labels: np.full((10, 12), 7)),
    ('classes.txt', 'label_type: IMAGE', lambda i, labels: np.full((10, 12), 2 * i)),
    ('classes.txt', '', lambda i, labels: np.full((10, 12), 2 * i)),     # DeepLab's default
    ('pairs.txt', 'label_type: PIXEL', lambda i, labels: labels[i]),
    ('pairs.txt', '', lambda i, labels: labels[i]),        # no number: a label image
], ids=['NONE', 'IMAGE', 'default with classes', 'PIXEL', 'default with label images'])
def test_label_type_says_what_a_list_line_names(pairs, listing, image, want):
    root, _, labels = pairs
    layer, top = seg(root, listing, image=image)
    _, label, dim = forward(layer, top)
    for i in range(3):
        np.testing.assert_array_equal(label[i, 0], want(i, labels))
    np.testing.assert_array_equal(dim.reshape(3, 2), [[10, 12]] * 3)


def test_label_type_image_names_deeplab_when_a_line_names_a_file(pairs):
    root, _, _ = pairs
    with pytest.raises(CaffeError) as info:
        seg(root, 'pairs.txt', image='label_type: IMAGE')
    assert str(info.value) == (
        "layer 'data' (type ImageSegData): as DeepLab's ImageSegData (deeplab-public-ver2): "
        "%s:1: label_type IMAGE reads the second word as the class of the whole image (0 to "
        "255), got 'l0.png'; label images need label_type: PIXEL" % (root / 'pairs.txt'))


def test_scale_factors_truncate_the_size_as_deeplab_does(pairs):
    """10 x 12 at 0.75 is int(7.5) x int(9.0) = 7 x 9 (rounding would give 8 x 9); the image
    bilinear, the labels by nearest neighbour, in TEST too."""
    root, images, labels = pairs
    layer, top = seg(root, transform='scale_factors: 0.75', batch=1, tops=2)
    data, label = forward(layer, top)
    assert data.shape == (1, 3, 7, 9)
    np.testing.assert_array_equal(data[0], cv2.resize(images[0], (9, 7)).transpose(2, 0, 1))
    np.testing.assert_array_equal(label[0, 0], cv2.resize(labels[0], (9, 7),
                                                          interpolation=cv2.INTER_NEAREST))


def test_crop_height_and_width_cut_and_pad_with_ignore_label(pairs):
    root, images, labels = pairs
    layer, top = seg(root, image='ignore_label: 9', transform='crop_height: 6 crop_width: 14 '
                     'mean_value: 5 mean_value: 50 mean_value: 80')
    data, label, dim = forward(layer, top)
    assert data.shape == (3, 3, 6, 14)
    # TEST: the window is centred in the image padded to at least the crop
    np.testing.assert_array_equal(label[0, 0, :, :12], labels[0][2:8])
    assert (label[:, :, :, 12:] == 9).all() and (data[:, :, :, 12:] == 0).all()
    np.testing.assert_array_equal(dim.reshape(3, 2), [[6, 12]] * 3)
    with pytest.raises(CaffeError, match='give crop_size, or both crop_height and crop_width'):
        seg(root, transform='crop_size: 5 crop_height: 6 crop_width: 6')


def test_deeplab_flips_in_test_too(pairs):
    root, images, _ = pairs
    layer, top = seg(root, transform='mirror: true', batch=12, tops=2)
    data, label = forward(layer, top)
    np.testing.assert_array_equal(data[:, 0], 10 * label[:, 0])
    flipped = [np.array_equal(data[i], images[i % 3][:, ::-1].transpose(2, 0, 1))
               for i in range(12)]
    assert 0 < sum(flipped) < 12


def test_new_size_resizes_label_images_bilinearly_as_deeplab_reads_them(pairs):
    root, images, labels = pairs
    layer, top = seg(root, image='label_type: PIXEL new_height: 5 new_width: 9', batch=1)
    data, label, dim = forward(layer, top)
    np.testing.assert_array_equal(data[0], cv2.resize(images[0], (9, 5)).transpose(2, 0, 1))
    np.testing.assert_array_equal(label[0, 0], cv2.resize(labels[0], (9, 5)))
    np.testing.assert_array_equal(dim.ravel(), [5, 9])


# ---- MatWrite and MatRead ---------------------------------------------------------------------
def mat_write(tmp_path, names='', extra=''):
    source = ''
    if names:
        (tmp_path / 'ids.txt').write_text(names)
        source = 'source: "%s"' % (tmp_path / 'ids.txt')
    return ('name: "out" type: "MatWrite" bottom: "a" bottom: "b" mat_write_param { prefix: '
            '"%s/" %s %s }' % (tmp_path, source, extra))


@pytest.mark.parametrize('dtype, kind', [(np.float32, np.float32), (np.float64, np.float64)])
def test_mat_write_files_read_back_with_scipy(tmp_path, dtype, kind):
    rs = np.random.RandomState(0)
    a, b = rs.standard_normal((1, 3, 4, 5)), rs.standard_normal((2, 2, 3))
    layer, bottom, top = build_layer(mat_write(tmp_path, '2007_000033.jpg x\n2007_000042.jpg\n',
                                               'strip: 4'), [a, b], phase=TEST, dtype=dtype)
    layer.forward(bottom, top)
    written = scipy_io.loadmat(str(tmp_path / '2007_000033_blob_0.mat'))['data']
    assert written.dtype == kind and written.shape == (5, 4, 3, 1)
    np.testing.assert_array_equal(written.transpose(3, 2, 1, 0), a.astype(dtype))
    second = scipy_io.loadmat(str(tmp_path / '2007_000033_blob_1.mat'))['data']
    np.testing.assert_array_equal(second.transpose(3, 2, 1, 0), b[None].astype(dtype))
    layer.forward(bottom, top)
    assert (tmp_path / '2007_000042_blob_1.mat').exists()
    with pytest.raises(CaffeError, match=r"forward 3, but source .*ids.txt names 2 files"):
        layer.forward(bottom, top)


def test_mat_write_without_a_source_counts_its_period(tmp_path):
    x = np.ones((1, 1, 2, 2))
    layer, bottom, top = build_layer(mat_write(tmp_path, extra='period: 2').replace(
        'bottom: "b" ', ''), [x], phase=TEST)
    for _ in range(5):
        layer.forward(bottom, top)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        'iter_0_blob_0.mat', 'iter_2_blob_0.mat', 'iter_4_blob_0.mat']


@pytest.mark.parametrize('param, message', [
    ('mat_write_param { period: 1 }', 'mat_write_param.prefix is required'),
    ('mat_write_param { prefix: "/nonexistent/folder/x" }', "the folder of '/nonexistent/folder"),
    ('mat_write_param { prefix: "p" period: 0 }', 'period must be > 0, got 0'),
])
def test_mat_write_refusals_are_one_line(param, message):
    with pytest.raises(CaffeError, match=message):
        layer, bottom, top = build_layer('name: "out" type: "MatWrite" bottom: "a" ' + param,
                                         [np.zeros((1, 1, 1, 1))], phase=TEST)
        layer.forward(bottom, top)


def test_mat_read_reads_what_mat_write_wrote(tmp_path):
    rs = np.random.RandomState(1)
    written = []
    layer, bottom, top = build_layer(mat_write(tmp_path, 'p\nq\n'), [
        np.zeros((1, 2, 3, 4)), np.zeros((1, 1, 3, 4))], phase=TEST, dtype=np.float32)
    for _ in range(2):
        written.append([rs.standard_normal(b.shape).astype(np.float32) for b in bottom])
        for blob, value in zip(bottom, written[-1]):
            blob.data[...] = value
        layer.forward(bottom, top)
    reader, _, tops = build_layer(
        'name: "in" type: "MatRead" top: "a" top: "b" mat_read_param { prefix: "%s/" source: '
        '"%s" batch_size: 3 }' % (tmp_path, tmp_path / 'ids.txt'), [], phase=TEST,
        dtype=np.float32)
    assert tops[0].shape == (3, 2, 3, 4) and tops[1].shape == (3, 1, 3, 4)
    reader.forward([], tops)
    for row, which in enumerate([0, 1, 0]):          # the names cycle
        np.testing.assert_array_equal(tops[0].data[row], written[which][0][0])
        np.testing.assert_array_equal(tops[1].data[row], written[which][1][0])


def test_mat_read_refuses_a_file_of_several_items(tmp_path):
    scipy_io.savemat(str(tmp_path / 'iter_0_blob_0.mat'), {'data': np.zeros((2, 2, 1, 2),
                                                                              np.float32)})
    with pytest.raises(CaffeError, match=r"holds 2 items \(MATLAB size\(data, 4\)\); MatRead "
                                         'reads one per file'):
        build_layer('name: "in" type: "MatRead" top: "a" mat_read_param { prefix: "%s/" }'
                    % tmp_path, [], phase=TEST)
    scipy_io.savemat(str(tmp_path / 'iter_0_blob_0.mat'), {'data': np.zeros((2, 2), np.int32)})
    with pytest.raises(CaffeError, match="'data' must be single or double"):
        build_layer('name: "in" type: "MatRead" top: "a" mat_read_param { prefix: "%s/" }'
                    % tmp_path, [], phase=TEST)


def test_mat_write_is_no_onnx_node(tmp_path):
    text = ('layer { name: "a" type: "Input" top: "a" input_param { shape { dim: 1 dim: 1 } } }'
            ' layer { %s }' % mat_write(tmp_path).replace('bottom: "b" ', ''))
    with pytest.raises(CaffeError, match='writes files: export a deploy net'):
        to_onnx(text_format.Parse(text, caffe_pb2.NetParameter()))
