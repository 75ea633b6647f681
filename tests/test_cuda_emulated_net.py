"""The layers' switch to the kernels of cuda/ (``LayerContext.cuda_kernels``), through a whole
net: with the kernels emulated on the CPU (tests/helpers/cuda_emulation.py), a TRAIN net that uses
every layer with a kernel (2-D convolution, BN and SyncBN, MAX and AVE pooling, LRN, Interp,
SoftmaxWithLoss) must give the loss, activations and gradients of the array code."""
import numpy as np
import pytest
from helpers.cuda_emulation import emulated_kernels

from caffe_syncbn import TEST, TRAIN, Net, caffe_pb2
from caffe_syncbn.layer import LayerContext
from caffe_syncbn.netparam.prototxt import parse_text

NET = '''
name: "kernels"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 9 dim: 9 } shape { dim: 2 dim: 1 dim: 9 dim: 9 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "uniform" } } }
layer { name: "bn1" type: "%(bn)s" bottom: "conv1" top: "conv1"
        bn_param { slope_filler { type: "uniform" min: 0.5 max: 1.5 } bias_filler { type: "gaussian" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool_max" type: "Pooling" bottom: "conv1" top: "pool_max" top: "pool_mask"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "norm" type: "LRN" bottom: "pool_max" top: "norm" lrn_param { local_size: 3 alpha: 0.5 } }
layer { name: "conv2" type: "Convolution" bottom: "norm" top: "conv2"
        convolution_param { num_output: 5 kernel_size: 2 stride: 1 dilation: 2 pad: 1
                            weight_filler { type: "xavier" } } }
layer { name: "pool_ave" type: "Pooling" bottom: "conv2" top: "pool_ave"
        pooling_param { pool: AVE kernel_size: 2 stride: 1 pad: 1 } }
layer { name: "score" type: "Interp" bottom: "pool_ave" top: "score" interp_param { height: 9 width: 9 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss"
        loss_param { ignore_label: 4 } }
'''


def run(bn, phase, dtype, kernels):
    net = Net(parse_text(NET % {"bn": bn}, caffe_pb2.NetParameter()), phase,
              context=LayerContext(dtype=dtype, rng=np.random.RandomState(0),
                                   cuda_kernels=kernels))
    rs = np.random.RandomState(1)
    for layer in net.layers:                 # the same weights on both paths
        for blob in layer.blobs:
            blob.data[...] = rs.uniform(0.5, 1.5, blob.shape)
    net.blobs['data'].data[...] = rs.standard_normal(net.blobs['data'].shape) * 3 + 2
    net.blobs['label'].data[...] = rs.randint(0, 5, net.blobs['label'].shape)
    for step in range(2):                    # the second step normalizes with updated stats
        net.clear_param_diffs()
        net.forward()
        net.backward()
    return net


@pytest.mark.parametrize('bn', ['BN', 'SyncBN'])
@pytest.mark.parametrize('phase', [TRAIN, TEST])
@pytest.mark.parametrize('dtype', [np.float64, np.float32])
def test_net_on_kernels_equals_array_code(monkeypatch, bn, phase, dtype):
    emulated_kernels(monkeypatch)
    reference, fast = run(bn, phase, dtype, False), run(bn, phase, dtype, True)
    tol = 1e-10 if dtype == np.float64 else 2e-4
    assert float(fast.blobs['loss'].data) > 0
    for name, blob in reference.blobs.items():
        scale = max(1.0, float(np.abs(blob.data).max(initial=0)))
        np.testing.assert_allclose(fast.blobs[name].data, blob.data, rtol=tol, atol=tol * scale,
                                   err_msg='data of ' + name)
        if name not in ('data', 'label'):
            scale = max(1e-3, float(np.abs(blob.diff).max(initial=0)))
            np.testing.assert_allclose(fast.blobs[name].diff, blob.diff, rtol=tol,
                                       atol=tol * scale, err_msg='diff of ' + name)
    for name in reference.params:
        for i, (ref, got) in enumerate(zip(reference.params[name], fast.params[name])):
            scale = max(1e-3, float(np.abs(ref.diff).max(initial=0)))
            np.testing.assert_allclose(got.data, ref.data, rtol=tol, atol=tol, err_msg=name)
            np.testing.assert_allclose(got.diff, ref.diff, rtol=tol, atol=tol * scale,
                                       err_msg='%s param %d diff' % (name, i))


def test_switch_reaches_every_kernel_layer(monkeypatch):
    """Each kernel-backed layer type of the net above really calls a kernel."""
    emulated_kernels(monkeypatch)
    from caffe_syncbn.backend import cuda_kernels
    called = set()
    original = cuda_kernels.kernel
    monkeypatch.setattr(cuda_kernels, 'kernel',
                        lambda stem, name: called.add(stem) or original(stem, name))
    run('SyncBN', TRAIN, np.float64, True)
    assert called == {'conv', 'norm', 'pooling', 'lrn', 'interp', 'loss'}, called
