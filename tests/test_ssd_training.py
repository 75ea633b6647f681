"""SSD training end to end: AnnotatedData, SyncBN and MultiBoxLoss on N virtual CPU
devices take the same steps as one device on the whole batch."""
import pathlib

import numpy as np
import pytest

from caffe_syncbn import caffe_pb2
from caffe_syncbn.backend import to_numpy
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.training.solvers import get_solver

LMDB = pathlib.Path(__file__).parent / 'ssd_golden' / 'annoset' / 'fork_xml_lmdb'

NET = '''
name: "tiny_ssd"
layer { name: "data" type: "AnnotatedData" top: "data" top: "label"
        transform_param { scale: 0.0078125 mean_value: 127.5
                          resize_param { resize_mode: WARP height: 16 width: 16 } }
        data_param { source: "%(source)s" batch_size: %(batch)d backend: LMDB } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 8 kernel_size: 3 stride: 2 pad: 1
                            weight_filler { type: "gaussian" std: 0.2 } } }
layer { name: "bn" type: "%(bn)s" bottom: "conv" top: "conv"
        bn_param { slope_filler { type: "constant" value: 1 } bias_filler { type: "constant" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "loc" type: "Convolution" bottom: "conv" top: "loc"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loc_perm" type: "Permute" bottom: "loc" top: "loc_perm"
        permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "loc_flat" type: "Flatten" bottom: "loc_perm" top: "loc_flat" }
layer { name: "conf" type: "Convolution" bottom: "conv" top: "conf"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "conf_perm" type: "Permute" bottom: "conf" top: "conf_perm"
        permute_param { order: 0 order: 2 order: 3 order: 1 } }
layer { name: "conf_flat" type: "Flatten" bottom: "conf_perm" top: "conf_flat" }
layer { name: "priors" type: "PriorBox" bottom: "conv" bottom: "data" top: "priors"
        prior_box_param { min_size: 5 max_size: 10 variance: 0.1 variance: 0.1
                          variance: 0.2 variance: 0.2 } }
layer { name: "loss" type: "MultiBoxLoss" bottom: "loc_flat" bottom: "conf_flat"
        bottom: "priors" bottom: "label" top: "loss"
        propagate_down: true propagate_down: true propagate_down: false propagate_down: false
        multibox_loss_param { num_classes: 4 overlap_threshold: 0.3 code_type: CENTER_SIZE } }
'''


def train(devices, per_device, bn='SyncBN', steps=3):
    param = parse_text('base_lr: 0.05 momentum: 0.9 lr_policy: "fixed" max_iter: 10 '
                       'display: 0 random_seed: 3', caffe_pb2.SolverParameter())
    param.net_param.CopyFrom(parse_text(NET % {'source': LMDB, 'batch': per_device, 'bn': bn},
                                        caffe_pb2.NetParameter()))
    solver = get_solver(param, devices=devices, dtype=np.float64)
    solver.step(steps)
    params = [to_numpy(b.data).copy() for b in solver.replicas[0].learnable_params]
    solver.close()
    return params


def test_two_devices_of_two_images_equal_one_device_of_four():
    one = train('cpu:1', 4)
    two = train('cpu:2', 2)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(one, two)) <= 1e-10
    moved = train('cpu:1', 4, steps=0)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(one, moved)) > 1e-3


def test_per_device_bn_differs():
    one = train('cpu:1', 4, bn='BN')
    two = train('cpu:2', 2, bn='BN')
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(one, two)) > 1e-6


def test_priors_that_would_need_a_gradient_are_one_clear_error():
    param = parse_text('base_lr: 0.05 lr_policy: "fixed" display: 0', caffe_pb2.SolverParameter())
    net = (NET % {'source': LMDB, 'batch': 2, 'bn': 'SyncBN'}).replace(
        'propagate_down: true propagate_down: true propagate_down: false propagate_down: false',
        '')
    param.net_param.CopyFrom(parse_text(net, caffe_pb2.NetParameter()))
    solver = get_solver(param, devices='cpu:1', dtype=np.float64)
    with pytest.raises(CaffeError, match='propagate_down: true true false false'):
        solver.step(1)
    solver.close()


GOLDEN = pathlib.Path(__file__).parent / 'ssd_golden'


def fork_trajectory(monkeypatch, devices, batch):
    """Our five iterations of the fork's golden solver (ssd_golden/solver_tiny_ssd*): the
    loss of each and the solver's net after them."""
    monkeypatch.chdir(GOLDEN)             # the net names its LMDB relative to this folder
    param = parse_text((GOLDEN / 'solver_tiny_ssd.solver.prototxt').read_text(),
                       caffe_pb2.SolverParameter())
    param.ClearField('net')
    text = (GOLDEN / 'solver_tiny_ssd.prototxt').read_text()
    param.net_param.CopyFrom(parse_text(text.replace('batch_size: 2', 'batch_size: %d' % batch),
                                        caffe_pb2.NetParameter()))
    solver = get_solver(param, devices=devices, sync_bn=devices is not None,
                        weights=None if devices is None else ['solver_tiny_ssd_init.caffemodel'])
    if devices is None:
        solver.net.copy_from('solver_tiny_ssd_init.caffemodel')
    losses = []
    for _ in range(5):
        solver.step(1)
        losses.append(solver.smoothed_loss)
    return losses, solver


def test_five_solver_iterations_follow_the_fork(monkeypatch):
    reference = np.load(GOLDEN / 'solver_tiny_ssd.npz')
    losses, solver = fork_trajectory(monkeypatch, None, 2)
    np.testing.assert_allclose(losses, [float(reference['loss/%d' % i]) for i in range(5)],
                               rtol=2e-5)
    for key in (k for k in reference.files if k.startswith('param_after/')):
        _, layer, index = key.split('/')
        np.testing.assert_allclose(solver.net.params[layer][int(index)].data, reference[key],
                                   rtol=1e-4, atol=1e-6, err_msg=key)


def test_two_devices_of_one_image_under_sync_bn_follow_the_fork(monkeypatch):
    """The fork's BatchNorm + Scale on 2 images; here SyncBN on 2 devices of 1 image."""
    reference = np.load(GOLDEN / 'solver_tiny_ssd.npz')
    losses, solver = fork_trajectory(monkeypatch, 'cpu:2', 1)
    solver.close()
    np.testing.assert_allclose(losses, [float(reference['loss/%d' % i]) for i in range(5)],
                               rtol=2e-5)
