"""The cuDNN convolution engine on a GPU (stage 2 of make gpu-check: `pytest -m cudnn`): every
geometry of the emulated tests (tests/layers/test_conv_cudnn.py) with cuDNN's own passes
against the float64 array engine; float32 as exact as the CUDA im2col engine with TF32 off
and within TF32's rounding with it on; weight gradients that add up; SyncBN training on
gpu:0,0 through cuDNN equal to cpu:2."""
import importlib

import numpy as np
import pytest
from gpu_support import require_gpu

cupy = require_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.cudnn]

from helpers.arrays import randn  # noqa: E402
from helpers.engines import Engine, assert_matches, reference  # noqa: E402
from helpers.layer_cases import CUDNN_CONVOLUTIONS, convolution  # noqa: E402
from test_data_parallel import batches, max_difference, train  # noqa: E402

from caffe_syncbn.backend import cudnn_conv  # noqa: E402
from caffe_syncbn.layers.conv import gpu as conv_gpu, gpu_cudnn  # noqa: E402

try:
    importlib.import_module('cudnn')
except Exception as exc:            # ImportError, or libcudnn that does not load
    pytest.skip('the cuDNN frontend does not import (%s): make gpu-bundle carries its wheel'
                % exc, allow_module_level=True)


@pytest.fixture
def gpu(monkeypatch):
    """An Engine on the GPU with the cuDNN engine switched on, TF32 off."""
    monkeypatch.setenv(cudnn_conv.SWITCH, '1')
    monkeypatch.setenv('CUPY_TF32', '0')
    cudnn_conv.frontend.cache_clear()
    return Engine('gpu', monkeypatch)


@pytest.mark.parametrize('kind, body, shape', CUDNN_CONVOLUTIONS)
@pytest.mark.parametrize('dtype', [np.float32, np.float16])
def test_cudnn_gives_the_float64_array_engine(gpu, kind, body, shape, dtype):
    text, x = convolution(body, kind), [randn(*shape)]
    assert gpu.build(text, x, dtype=dtype)[0].engine is gpu_cudnn
    assert_matches(gpu.run(text, x, dtype=dtype), reference(text, x), dtype, kind + body)


def _relative_error(got, want):
    return max(float(np.abs(a - b).max() / np.abs(b).max())
               for key in ('top', 'bottom_diff', 'param_diff') for a, b in zip(got[key], want[key]))


@pytest.mark.parametrize('tf32, bound', [('0', 1e-5), ('1', 1e-2)])
def test_float32_keeps_its_precision_unless_tf32_is_allowed(gpu, monkeypatch, tf32, bound):
    """A ResNet-sized 3x3 convolution (sums of 576 products): TF32 rounds each input to 10
    bits, some 1e-3 relative; float32 stays within 1e-5 of float64, as im2col does."""
    monkeypatch.setenv('CUPY_TF32', tf32)
    text = convolution('num_output: 64 kernel_size: 3 pad: 1')
    x = [randn(4, 64, 28, 28)]
    want = reference(text, x)
    got = gpu.run(text, x, dtype=np.float32)
    im2col_error = None
    if tf32 == '0':
        monkeypatch.setenv(cudnn_conv.SWITCH, '0')
        im2col_error = _relative_error(gpu.run(text, x, dtype=np.float32), want)
    assert _relative_error(got, want) <= bound, (_relative_error(got, want), im2col_error)


def test_weight_gradients_add_up(gpu):
    layer, bottom, top = gpu.build(convolution('num_output: 8 kernel_size: 3 pad: 1 group: 2'),
                                   [randn(2, 4, 9, 7)], dtype=np.float32)
    gpu.forward(layer, bottom, top)
    top[0].diff[...] = cupy.asarray(randn(*top[0].shape).astype(np.float32))
    for blob in layer.blobs:
        blob.diff[...] = 0
    layer.backward(top, [True], bottom)
    once = [gpu.host(b.diff).copy() for b in layer.blobs]
    layer.backward(top, [True], bottom)
    for first, second in zip(once, [gpu.host(b.diff) for b in layer.blobs]):
        np.testing.assert_allclose(second, 2 * first, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('body, dtype', [('engine: CAFFE', np.float32), ('', np.float64)])
def test_engine_caffe_and_float64_keep_im2col(gpu, body, dtype):
    layer, _, _ = gpu.build(convolution('num_output: 2 kernel_size: 3 ' + body),
                            [randn(1, 2, 5, 5)], dtype=dtype)
    assert layer.engine is conv_gpu


def test_syncbn_training_on_gpu_0_0_through_cudnn_equals_the_cpu(gpu):
    data = batches(3)
    cpu, cpu_stats = train('cpu:2', data)
    through_cudnn, stats = train('gpu:0,0', data)
    assert max_difference(cpu[0], through_cudnn[0]) <= 1e-4
    assert max_difference(cpu_stats[0], stats[0]) <= 1e-4
