"""The cuDNN convolution engine (layers/conv/gpu_cudnn.py, backend/cudnn_conv.py) without a GPU:
on the GPU emulation with a stand-in of the cuDNN frontend (helpers/fake_cudnn.py) whose
passes are its own float64 loops. What a GPU alone can show (cuDNN's own results, its
speed, TF32's rounding) is tests/gpu/test_gpu_cudnn.py's, in stage 2 of make gpu-check.

Here: (de)convolutions of every geometry against the float64 array engine, weight gradients
that add up as Caffe's; one build per geometry, thread and device; a handle per thread and
device, on the stream of the thread that runs it; the TF32 rule; the engine chosen only
where it is switched on and applies; and SyncBN training on gpu:0,0 through it equal to
the CPU's."""
import gc
import importlib
import logging
import sys
import threading

import numpy as np
import pytest
from helpers import fake_cudnn
from helpers.arrays import randn
from helpers.emulated_gpu import emulated_gpu
from helpers.engines import Engine, assert_matches, reference
from helpers.layer_cases import CUDNN_CONVOLUTIONS, convolution
from test_data_parallel import batches, max_difference, train

from caffe_syncbn.backend import cudnn_conv, device
from caffe_syncbn.layers.conv import array as conv_array, gpu as conv_gpu, gpu_cudnn


@pytest.fixture
def emulated(monkeypatch):
    """An Engine on the GPU emulation with the fake frontend in place; (engine, fake)."""
    engine = Engine('cuda-emulated', monkeypatch)
    with fake_cudnn.installed(monkeypatch, device.RUNTIMES['gpu']) as fake:
        yield engine, fake


@pytest.mark.parametrize('kind, body, shape', CUDNN_CONVOLUTIONS)
@pytest.mark.parametrize('dtype', [np.float32, np.float16])
def test_the_engine_gives_the_float64_array_engine(emulated, kind, body, shape, dtype):
    engine, fake = emulated
    text, x = convolution(body, kind), [randn(*shape)]
    layer, _, _ = engine.build(text, x, dtype=dtype)
    assert layer.engine is gpu_cudnn
    assert_matches(engine.run(text, x, dtype=dtype), reference(text, x), dtype, kind + body)
    assert sorted({b['step'] for b in fake.builds}) == ['dgrad', 'fprop', 'wgrad']


def test_weight_gradients_add_up_and_the_data_gradient_is_written(emulated):
    engine, fake = emulated
    layer, bottom, top = engine.build(convolution('num_output: 4 kernel_size: 3 pad: 1 group: 2'),
                                      [randn(2, 4, 6, 5)], dtype=np.float32)
    engine.forward(layer, bottom, top)
    top[0].diff[...] = engine.xp.asarray(randn(*top[0].shape).astype(np.float32))
    for b in [bottom[0]] + layer.blobs:
        b.diff[...] = 0
    layer.backward(top, [True], bottom)
    once = [engine.host(b.diff).copy() for b in [bottom[0]] + layer.blobs]
    layer.backward(top, [True], bottom)
    twice = [engine.host(b.diff) for b in [bottom[0]] + layer.blobs]
    np.testing.assert_allclose(twice[0], once[0], rtol=1e-6)        # bottom diff: written
    for param_once, param_twice in zip(once[1:], twice[1:]):        # param diffs: added
        np.testing.assert_allclose(param_twice, 2 * param_once, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('refused', [{'fprop'}, {'dgrad'}, {'wgrad'}])
def test_a_pass_without_a_plan_runs_im2col_and_the_log_says_so_once(emulated, records,
                                                                     refused):
    engine, fake = emulated
    fake.refused = refused
    text, x = convolution('num_output: 4 kernel_size: 3 stride: 2 pad: 1'), [randn(2, 3, 7, 6)]
    for _ in range(2):
        assert_matches(engine.run(text, x, dtype=np.float32), reference(text, x), np.float32)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and 'cuDNN builds no %s plan' % min(refused) in warnings[0]


def test_a_geometry_builds_once_per_thread_and_device(emulated):
    engine, fake = emulated
    text = convolution('num_output: 3 kernel_size: 3 pad: 1')
    for _ in range(2):
        engine.run(text, [randn(2, 2, 5, 4)], dtype=np.float32)
    assert [b['step'] for b in fake.builds] == ['fprop', 'wgrad', 'dgrad']
    assert fake.executes == 6 and len(fake.handles) == 1
    engine.run(text, [randn(3, 2, 5, 4)], dtype=np.float32)          # another batch
    engine.run(text, [randn(2, 2, 5, 4)], dtype=np.float16)          # another dtype
    engine.run(convolution('num_output: 3 kernel_size: 3 pad: 1 dilation: 2'), [randn(2, 2, 5, 4)],
               dtype=np.float32)
    assert len(fake.builds) == 12 and len(fake.handles) == 1
    dims = {(b['step'], b['data_type']) + tuple(map(tuple, b['dims'])) for b in fake.builds}
    assert len(dims) == 12
    assert fake.builds[3]['dims'][0] == [3, 2, 5, 4]


@pytest.mark.parametrize('dtype, tf32, tensor_cores', [
    (np.float32, '0', False), (np.float32, '1', True), (np.float16, '0', True)])
def test_float32_runs_tensor_cores_only_where_tf32_is_allowed(emulated, monkeypatch, dtype,
                                                              tf32, tensor_cores):
    engine, fake = emulated
    monkeypatch.setenv('CUPY_TF32', tf32)
    engine.run(convolution('num_output: 3 kernel_size: 3 pad: 1'), [randn(2, 2, 5, 4)], dtype=dtype)
    for build in fake.builds:
        assert ('TENSOR_CORE' not in build['left_out']) == tensor_cores, build
        assert {'DOWN_CONVERT_INPUTS', 'REDUCED_PRECISION_REDUCTION'} <= set(build['left_out'])


@pytest.mark.parametrize('body, dtype, shape, chosen', [
    ('num_output: 2 kernel_size: 3', np.float32, (1, 2, 5, 5), gpu_cudnn),
    ('num_output: 2 kernel_size: 3 engine: CUDNN', np.float32, (1, 2, 5, 5), gpu_cudnn),
    ('num_output: 2 kernel_size: 3 engine: CAFFE', np.float32, (1, 2, 5, 5), conv_gpu),
    ('num_output: 2 kernel_size: 3', np.float64, (1, 2, 5, 5), conv_gpu),
    ('num_output: 2 kernel_size: 3', np.float32, (1, 2, 7), conv_array),     # 1-D
])
def test_the_engine_is_chosen_where_it_applies(emulated, body, dtype, shape, chosen):
    engine, _ = emulated
    layer, _, _ = engine.build(convolution(body), [randn(*shape)], dtype=dtype)
    assert layer.engine is chosen


def test_without_the_switch_convolutions_run_im2col(emulated, monkeypatch):
    engine, fake = emulated
    monkeypatch.setenv(cudnn_conv.SWITCH, '0')
    layer, _, _ = engine.build(convolution('num_output: 2 kernel_size: 3'), [randn(1, 2, 5, 5)],
                               dtype=np.float32)
    assert layer.engine is conv_gpu and fake.builds == []


def test_without_the_frontend_convolutions_run_im2col_and_the_log_says_so_once(
        monkeypatch, records):
    engine = Engine('cuda-emulated', monkeypatch)
    monkeypatch.setitem(sys.modules, 'cudnn', None)         # the import fails
    monkeypatch.setenv(cudnn_conv.SWITCH, '1')
    cudnn_conv.frontend.cache_clear()
    try:
        for _ in range(2):
            layer, _, _ = engine.build(convolution('num_output: 2 kernel_size: 3'),
                                       [randn(1, 2, 5, 5)], dtype=np.float32)
            assert layer.engine is conv_gpu
    finally:
        cudnn_conv.frontend.cache_clear()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and 'cuDNN frontend does not import' in warnings[0], warnings


def test_a_threads_handle_is_destroyed_when_the_thread_ends(emulated):
    engine, fake = emulated
    layer, bottom, top = engine.build(convolution('num_output: 2 kernel_size: 3'),
                                      [randn(1, 2, 5, 5)], dtype=np.float32)
    worker = threading.Thread(target=engine.forward, args=(layer, bottom, top))
    worker.start()
    worker.join()
    gc.collect()
    assert len(fake.handles) == 1 and fake.handles[0].destroyed


@pytest.mark.parametrize('devices', ['gpu:0,0', 'gpu:0,1'])
def test_syncbn_training_through_cudnn_equals_the_cpu(monkeypatch, devices):
    """Two replicas, each its worker thread on a stream of its own: a handle each on its
    device, graphs built in each thread, every pass on the stream of the thread that ran it."""
    runtime = emulated_gpu(monkeypatch)
    data = batches(3)
    cpu, cpu_stats = train('cpu:2', data)
    with fake_cudnn.installed(monkeypatch, runtime) as fake:
        emulated, emulated_stats = train(devices, data)
    assert sorted(handle.device for handle in fake.handles) == [int(devices[-3]), int(devices[-1])]
    assert max_difference(cpu[0], emulated[0]) <= 1e-5
    assert max_difference(cpu_stats[0], emulated_stats[0]) <= 1e-5
    threads = {handle.thread for handle in fake.handles}
    assert len(fake.handles) == len(threads) >= 2
    assert {b['thread'] for b in fake.builds} <= threads
    # 3 iterations of 2 replicas: fprop and wgrad (the data takes no gradient)
    assert fake.executes == 3 * 2 * 2 and None not in fake.streams
    assert len(set(map(id, fake.streams))) == 2     # one stream per replica


# ---- the frontend itself, where it is installed (make test installs it: no GPU needed) ----------
@pytest.fixture
def frontend():
    try:
        return importlib.import_module('cudnn')
    except ImportError as exc:
        pytest.skip('the cuDNN frontend is not installed (%s): make test installs it' % exc)


@pytest.mark.parametrize('dtype, data_type', [('float32', 'FLOAT'), ('float16', 'HALF')])
def test_the_graphs_are_what_the_frontend_builds(frontend, dtype, data_type):
    """Every pass's graph defined with NVIDIA's own graph API (it defines graphs without a
    GPU; building one needs a device): its tensors take the dims, strides and data types of
    the geometry, and the frontend infers the fprop's output as Caffe's shape."""
    pad, stride, dilation = (1, 2), (2, 2), (2, 1)
    caffe_shape = conv_array.conv_output_shape((9, 8), (3, 3), pad, stride, dilation)
    geometry = cudnn_conv.Geometry('fprop', (2, 4, 9, 8), (6, 2, 3, 3), (2, 6) + caffe_shape,
                                   pad, stride, dilation, dtype, False)
    for step in cudnn_conv.PASSES:
        graph, tensors = cudnn_conv.define(frontend, geometry._replace(step=step))
        for role, tensor in tensors.items():
            shape = getattr(geometry, role)
            assert tensor.get_dim() == list(shape), (step, role)
            assert tensor.get_stride() == cudnn_conv.contiguous_strides(shape), (step, role)
            assert tensor.get_data_type() == getattr(frontend.data_type, data_type), (step, role)
    bare = frontend.pygraph(io_data_type=frontend.data_type.FLOAT,
                            compute_data_type=frontend.data_type.FLOAT)
    inferred = bare.conv_fprop(
        image=bare.tensor(name='x', dim=list(geometry.x), stride=[288, 72, 8, 1]),
        weight=bare.tensor(name='w', dim=list(geometry.w), stride=[18, 9, 3, 1]),
        padding=list(geometry.pad), stride=list(geometry.stride),
        dilation=list(geometry.dilation))
    assert inferred.get_dim() == list(geometry.y)
