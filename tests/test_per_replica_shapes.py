"""One image per device, of any size: each replica gets its own batch from the input
pipeline, shapes may differ between replicas, and SyncBN counts every pixel exactly."""
import numpy as np
import pytest

from caffe_syncbn.errors import CaffeError
from caffe_syncbn.training.solvers import get_solver

cv2 = pytest.importorskip('cv2')

#: whole images of four sizes, one per device
SIZES = [(5, 7), (6, 4), (3, 9), (8, 5)]

NET = '''name: "seg"
layer { name: "data" type: "SegData" top: "data" top: "label"
        seg_data_param { source: "%(list)s" root_dir: "%(root)s/" }
        image_data_param { batch_size: %(batch)d }
        transform_param { mean_value: 128 scale: 0.02 %(transform)s } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 6 kernel_size: %(kernel)d pad: %(pad)d
                            weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "score" type: "Convolution" bottom: "conv" top: "score"
        convolution_param { num_output: 3 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss"
        loss_param { ignore_label: 255 } }
'''

SOLVER = '''net: "%s"
base_lr: 0.1 momentum: 0.9 lr_policy: "fixed" max_iter: 10 display: 0 random_seed: 5
snapshot_prefix: "%s"
'''


def scene(rng, h, w):
    """An image and its labels (0..2, a few ignored), the image telling the classes apart."""
    labels = rng.randint(0, 3, (h, w)).astype(np.uint8)
    image = (labels[..., None] * 60 + rng.randint(0, 40, (h, w, 3))).astype(np.uint8)
    labels[rng.rand(h, w) < 0.1] = 255
    return image, labels


def write_set(folder, pairs):
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (image, labels) in enumerate(pairs):
        cv2.imwrite(str(folder / ('%d.png' % i)), image)
        cv2.imwrite(str(folder / ('%d_label.png' % i)), labels)
        lines.append('%d.png %d_label.png' % (i, i))
    (folder / 'list.txt').write_text('\n'.join(lines) + '\n')


def make_solver(folder, devices, batch=1, transform='', kernel=1):
    net = folder / 'net.prototxt'
    net.write_text(NET % {'list': folder / 'list.txt', 'root': folder, 'batch': batch,
                          'transform': transform, 'kernel': kernel, 'pad': kernel // 2})
    solver = folder / 'solver.prototxt'
    solver.write_text(SOLVER % (net, folder / 'snap'))
    return get_solver(str(solver), devices=devices, sync_bn=True)


def train(solver, iterations=3):
    try:
        solver.step(iterations)
        return {name: [b.data.copy() for b in blobs] for name, blobs in solver.net.params.items()}
    finally:
        solver.close()


def test_images_of_four_sizes_on_four_devices_equal_one_strip_of_their_pixels(tmp_path):
    """A net of 1x1 convolutions, BN and a per-pixel loss treats pixels one by one, so four
    images of different sizes on four devices train exactly as one 1 x P image holding all
    their pixels on one device: SyncBN's statistics and the loss count every pixel once."""
    rng = np.random.RandomState(0)
    pairs = [scene(rng, h, w) for h, w in SIZES]
    write_set(tmp_path / 'four', pairs)
    strip = [(np.concatenate([image.reshape(-1, 3) for image, _ in pairs])[None],
              np.concatenate([labels.reshape(-1) for _, labels in pairs])[None])]
    write_set(tmp_path / 'strip', strip)

    four = make_solver(tmp_path / 'four', 'cpu:4')
    shapes = []                          # the shapes each replica gets, per iteration
    original_step = four.forward_backward_all

    def recording_step():
        loss = original_step()
        shapes.append([r.blobs['data'].shape for r in four.replicas])
        return loss
    four.forward_backward_all = recording_step
    mine = train(four)
    assert shapes[0] == [(1, 3) + size for size in SIZES]          # one whole image each
    reference = train(make_solver(tmp_path / 'strip', 'cpu:1'))
    for name, blobs in reference.items():
        for j, blob in enumerate(blobs):
            np.testing.assert_allclose(mine[name][j], blob, rtol=2e-5, atol=2e-6,
                                       err_msg='%s[%d]' % (name, j))


def test_multi_scale_training_gives_each_device_its_own_size(tmp_path):
    rng = np.random.RandomState(1)
    write_set(tmp_path, [scene(rng, h, w) for h, w in SIZES * 2])
    solver = make_solver(tmp_path, 'cpu:4', transform='scale_ratios: 0.5 scale_ratios: 2',
                         kernel=3)
    seen, losses = [], []
    original_step = solver.forward_backward_all

    def recording_step():
        losses.append(original_step())
        seen.append([r.blobs['data'].shape[2:] for r in solver.replicas])
        return losses[-1]
    solver.forward_backward_all = recording_step
    train(solver, iterations=4)
    assert all(np.isfinite(losses))
    for shapes in seen:
        for (h, w), (oh, ow) in zip(shapes, SIZES):       # no shuffle: image r on device r
            assert 0.5 * oh - 1 <= h <= 2 * oh + 1 and 0.5 * ow - 1 <= w <= 2 * ow + 1
    assert len({shape for shapes in seen for shape in shapes}) > 4


def test_sizes_must_agree_within_one_device(tmp_path):
    rng = np.random.RandomState(2)
    write_set(tmp_path, [scene(rng, h, w) for h, w in SIZES])
    solver = make_solver(tmp_path, 'cpu:2', batch=2)
    with pytest.raises(CaffeError, match=r"crop_size.*\(window sizes \[\(5, 7\), \(6, 4\)\]\).*"
                                         r"batch_size: 1"):
        train(solver, iterations=1)


def test_n_devices_equal_one_device_with_random_crops_mirrors_and_scales(tmp_path):
    """The pipeline reads the global batch in order and draws the augmentation as one
    device would, so 4 devices x 1 image train as 1 device x 4 images, augmentation
    included (crop_size makes the windows of one device's images agree)."""
    rng = np.random.RandomState(3)
    write_set(tmp_path, [scene(rng, 9, 11) for _ in range(8)])
    transform = 'crop_size: 7 mirror: true scale_ratios: 0.75 scale_ratios: 1.5'
    four = train(make_solver(tmp_path, 'cpu:4', transform=transform, kernel=3))
    one = train(make_solver(tmp_path, 'cpu:1', batch=4, transform=transform, kernel=3))
    for name, blobs in one.items():
        for j, blob in enumerate(blobs):
            np.testing.assert_allclose(four[name][j], blob, rtol=2e-5, atol=2e-6,
                                       err_msg='%s[%d]' % (name, j))
