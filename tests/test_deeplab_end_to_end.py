"""A DeepLab v2 style net end to end: it trains under -sync_bn on ImageSegData lists of
images and label PNGs (written here with OpenCV), its frozen and its learned BatchNorms
made SyncBN, with DeepLab's augmentation (scale_factors, crop, mirror), its loss layer
without a top and SegAccuracy; 2 devices train as 1 device on the whole batch; then its
test net writes its scores with MatWrite, which scipy reads back."""
import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn.training.solvers import get_solver

cv2 = pytest.importorskip('cv2')
scipy_io = pytest.importorskip('scipy.io')

NET = '''name: "deeplab_style"
layer { name: "data" type: "ImageSegData" top: "data" top: "label"
  include { phase: TRAIN }
  transform_param { mirror: true crop_size: 17 mean_value: 104 mean_value: 117 mean_value: 123
                    scale_factors: 0.75 scale_factors: 1 scale_factors: 1.25 }
  image_data_param { root_folder: "%(root)s/" source: "%(root)s/train.txt" batch_size: %(batch)d
                     label_type: PIXEL } }
layer { name: "data" type: "ImageSegData" top: "data" top: "label" top: "data_dim"
  include { phase: TEST }
  transform_param { crop_size: 21 mean_value: 104 mean_value: 117 mean_value: 123 }
  image_data_param { root_folder: "%(root)s/" source: "%(root)s/test.txt" batch_size: 1
                     label_type: NONE } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  param { lr_mult: 1 decay_mult: 1 }
  convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1 bias_term: false
                      weight_filler { type: "msra" } } }
layer { name: "bn_conv1" type: "BatchNorm" bottom: "conv1" top: "conv1"
  batch_norm_param { use_global_stats: true }
  param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 } }
layer { name: "scale_conv1" type: "Scale" bottom: "conv1" top: "conv1"
  scale_param { bias_term: true } param { lr_mult: 0 } param { lr_mult: 0 } }
layer { name: "conv1_relu" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "res2a" type: "Convolution" bottom: "conv1" top: "res2a"
  convolution_param { num_output: 8 kernel_size: 3 pad: 2 dilation: 2 bias_term: false
                      weight_filler { type: "msra" } } }
layer { name: "bn2a" type: "BatchNorm" bottom: "res2a" top: "res2a" }
layer { name: "scale2a" type: "Scale" bottom: "res2a" top: "res2a" scale_param { bias_term: true } }
layer { name: "res2a_relu" type: "ReLU" bottom: "res2a" top: "res2a" }
layer { name: "fc1" type: "Convolution" bottom: "res2a" top: "fc1"
  convolution_param { num_output: 3 kernel_size: 3 pad: 2 dilation: 2
                      weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "label_shrink" type: "Interp" bottom: "label" top: "label_shrink"
  interp_param { shrink_factor: 2 pad_beg: 0 pad_end: 0 } include { phase: TRAIN } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc1" bottom: "label_shrink"
  include { phase: TRAIN } loss_param { ignore_label: 255 } }
layer { name: "accuracy" type: "SegAccuracy" bottom: "fc1" bottom: "label_shrink"
  top: "accuracy" seg_accuracy_param { ignore_label: 255 } include { phase: TRAIN } }
layer { name: "fc1_interp" type: "Interp" bottom: "fc1" top: "fc1_interp"
  interp_param { zoom_factor: 2 } include { phase: TEST } }
layer { name: "fc1_mat" type: "MatWrite" bottom: "fc1_interp" include { phase: TEST }
  mat_write_param { prefix: "%(root)s/features/" source: "%(root)s/test_id.txt" strip: 0
                    period: 1 } }
layer { name: "silence" type: "Silence" bottom: "label" bottom: "data_dim"
  include { phase: TEST } }
'''

SOLVER = '''net: "%s"
base_lr: 0.05 momentum: 0.9 lr_policy: "fixed" weight_decay: 0.0005 max_iter: 10
display: 0 random_seed: 7 snapshot_prefix: "%s"
'''


@pytest.fixture(scope='module')
def voc(tmp_path_factory):
    """Eight 20 x 23 scenes of three classes (a few pixels 255, ignored), as PNG pairs."""
    root = tmp_path_factory.mktemp('voc')
    rng = np.random.RandomState(0)
    names = []
    for i in range(8):
        labels = (np.arange(20)[:, None] // (3 + i % 3) + np.arange(23)[None] // 5) % 3
        labels = labels.astype(np.uint8)
        labels[rng.rand(20, 23) < 0.05] = 255
        image = (np.minimum(labels, 2)[..., None] * 70 + rng.randint(0, 50, (20, 23, 3)))
        cv2.imwrite(str(root / ('2007_%06d.jpg' % i)), image.astype(np.uint8))
        cv2.imwrite(str(root / ('2007_%06d.png' % i)), labels)
        names.append('2007_%06d' % i)
    (root / 'train.txt').write_text(''.join('%s.jpg %s.png\n' % (n, n) for n in names))
    (root / 'test.txt').write_text(''.join('%s.jpg\n' % n for n in names[:2]))
    (root / 'test_id.txt').write_text(''.join('%s\n' % n for n in names[:2]))
    (root / 'features').mkdir()
    return root


def solver_for(root, devices, batch):
    folder = root / ('run_%s_%d' % (devices.replace(':', ''), batch))
    folder.mkdir(exist_ok=True)
    net = folder / 'train.prototxt'
    net.write_text(NET % {'root': root, 'batch': batch})
    solver = folder / 'solver.prototxt'
    solver.write_text(SOLVER % (net, folder / 'snap'))
    return get_solver(str(solver), devices=devices, sync_bn=True), net


def train(root, devices, batch, iterations=3):
    solver, net = solver_for(root, devices, batch)
    try:
        kinds = {type(layer).__name__ for layer in solver.net.layers}
        assert 'SyncBN' in kinds and 'BatchNorm' not in kinds
        losses = []
        for _ in range(iterations):
            solver.step(1)
            losses.append(float(solver.net.blobs['loss'].data))
        weights = {name: [b.data.copy() for b in blobs]
                   for name, blobs in solver.net.params.items()}
        accuracy = solver.net.blobs['accuracy'].data.copy()
    finally:
        solver.close()
    return weights, losses, accuracy, net


def test_deeplab_net_trains_under_sync_bn_and_writes_mat_files(voc):
    two, losses, accuracy, net = train(voc, 'cpu:2', 2)
    one, one_losses, _, _ = train(voc, 'cpu:1', 4)
    assert one_losses[-1] < one_losses[0]
    assert all(np.isfinite(losses)) and accuracy.shape == (1, 1, 1, 3)
    assert 0 <= accuracy.min() and accuracy.max() <= 1
    for name, blobs in one.items():
        for j, blob in enumerate(blobs):
            np.testing.assert_allclose(two[name][j], blob, rtol=2e-4, atol=2e-5,
                                       err_msg='%s[%d]' % (name, j))
    # as SyncBN, [slope, bias, mean_sum, var_sum, s]: the frozen BatchNorm kept its
    # statistics and its Scale; the learned one moved them
    assert all(not np.any(blob) for blob in two['bn_conv1'][2:])
    assert np.all(two['bn_conv1'][0] == 1) and np.any(two['bn2a'][2] != 0)

    test = caffe.Net(str(net), caffe.TEST)
    test.copy_from(two)
    for name in ('2007_000000', '2007_000001'):
        test.forward()
        written = scipy_io.loadmat(str(voc / 'features' / (name + '_blob_0.mat')))['data']
        assert written.dtype == np.float32 and written.shape == (21, 21, 3, 1)
        np.testing.assert_array_equal(written.transpose(3, 2, 1, 0), test.blobs['fc1_interp'].data)
