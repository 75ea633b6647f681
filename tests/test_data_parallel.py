"""Data-parallel training on virtual CPU devices equals one device on the whole batch."""
import threading

import numpy as np
import pytest
from helpers import watchdog

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.backend import to_numpy
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.training.solvers import get_solver

NET = '''
name: "dp"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 16 dim: 3 dim: 8 dim: 8 } shape { dim: 16 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1
                            weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "bn" type: "%(bn)s" bottom: "conv" top: "conv"
        bn_param { slope_filler { type: "constant" value: 1 } bias_filler { type: "constant" }
                   momentum: 0.9 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss"
        loss_param { ignore_label: 4 } }
'''

SOLVER = '''
base_lr: 0.1 momentum: 0.9 weight_decay: 0.001 lr_policy: "fixed" max_iter: 100
display: 0 random_seed: 5
'''


def solver_param(bn='SyncBN'):
    param = parse_text(SOLVER, caffe_pb2.SolverParameter())
    param.net_param.CopyFrom(parse_text(NET % {'bn': bn}, caffe_pb2.NetParameter()))
    return param


def batches(steps, seed=0):
    rs = np.random.RandomState(seed)
    return [{'data': rs.standard_normal((16, 3, 8, 8)) * 2 + 1,
             'label': rs.randint(0, 5, 16).astype(np.float64)} for _ in range(steps)]


def train(devices, data, split=None, bn='SyncBN', dtype=np.float32, memory_plan='off'):
    solver = get_solver(solver_param(bn), devices=devices, dtype=dtype, memory_plan=memory_plan)
    feed = iter(data)

    def source():
        batch = next(feed)
        if split is None:
            return batch
        bounds = np.cumsum([0] + list(split))
        return [{k: v[a:b] for k, v in batch.items()} for a, b in zip(bounds[:-1], bounds[1:])]

    solver.set_data_source(source)
    solver.step(len(data))
    params = [[to_numpy(b.data).copy() for b in net.learnable_params] for net in solver.replicas]
    stats = [[to_numpy(b.data).copy() for b in net.params['bn']] for net in solver.replicas]
    solver.close()
    return params, stats


def max_difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def check_replicas_equal_one(one, many, split, memory_plan='off'):
    """5 steps on ``many`` devices (global batch split as ``split``) equal ``one`` device on
    the whole batch within 1e-5, and the replicas stay bitwise equal."""
    data = batches(5)
    single, single_stats = train(one, data, memory_plan=memory_plan)
    multi, multi_stats = train(many, data, split, memory_plan=memory_plan)
    assert max_difference(single[0], multi[0]) <= 1e-5
    assert max_difference(single_stats[0], multi_stats[0]) <= 1e-5
    for replica in multi[1:]:          # replicas never drift: bitwise equal
        for mine, root in zip(replica, multi[0]):
            assert np.array_equal(mine, root)


@pytest.mark.parametrize('split', [None, (5, 4, 4, 3), (7, 0, 6, 3)])
def test_four_devices_equal_one_device_on_the_whole_batch(split):
    check_replicas_equal_one('cpu:1', 'cpu:4', split)


def test_per_device_bn_does_not_equal_the_global_batch():
    """The same comparison with unsynchronized BN must fail: the test above has teeth."""
    data = batches(5)
    single, _ = train('cpu:1', data, bn='BN')
    multi, _ = train('cpu:4', data, (5, 4, 4, 3), bn='BN')
    assert max_difference(single[0], multi[0]) > 1e-3


def test_float64_equivalence_is_tight():
    data = batches(3, seed=3)
    single, single_stats = train('cpu:1', data, dtype=np.float64)
    multi, multi_stats = train('cpu:3', data, (2, 9, 5), dtype=np.float64)
    assert max_difference(single[0], multi[0]) <= 1e-10
    assert max_difference(single_stats[0], multi_stats[0]) <= 1e-10


class FailingLayer(caffe.Layer):
    """Passes data through; raises on replica 1 at its third forward."""
    calls = {}

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        rank = self.ctx.comm.rank
        count = FailingLayer.calls[rank] = FailingLayer.calls.get(rank, 0) + 1
        if rank == 1 and count == 3:
            raise ValueError('replica 1 broke at step 3')
        top[0].data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = top[0].diff


def check_a_failing_replica_stops_all(devices):
    """Replica 1 raises at step 3: every replica stops (one left waiting in a collective
    is a hang to the watchdog), the original error reaches the caller and no thread is
    left behind."""
    param = solver_param()
    layers = param.net_param.layer
    loss = caffe_pb2.LayerParameter()
    loss.CopyFrom(layers[-1])
    loss.bottom[0] = 'ip2'
    layers[-1].CopyFrom(parse_text(
        'name: "fail" type: "Python" bottom: "ip" top: "ip2" '
        'python_param { module: "test_data_parallel" layer: "FailingLayer" }',
        caffe_pb2.LayerParameter()))
    layers.add().CopyFrom(loss)
    FailingLayer.calls.clear()
    solver = get_solver(param, devices=devices)
    data = iter(batches(5))
    solver.set_data_source(lambda: next(data))
    threads_before = threading.active_count()
    with pytest.raises(ValueError, match='replica 1 broke at step 3'):
        watchdog.call(lambda: solver.step(5), 'the replicas after one failed')
    assert solver.iter == 2
    solver.close()
    assert threading.active_count() <= threads_before


def test_a_failing_replica_stops_all_and_raises_the_original_error():
    check_a_failing_replica_stops_all('cpu:4')


def test_device_strings():
    from caffe_syncbn.training.device_names import parse_devices
    assert parse_devices('cpu:4') == [('cpu', i) for i in range(4)]
    assert parse_devices(['cpu:0', 'cpu:1']) == [('cpu', 0), ('cpu', 1)]
    with pytest.raises(CaffeError):
        parse_devices('tpu:1')
    with pytest.raises(CaffeError, match='not a device number'):
        parse_devices('cpu:0,x')
    if caffe.backend.gpu_count() == 0:
        with pytest.raises(CaffeError, match='no GPU is available'):
            parse_devices('gpu:0,1')
    else:
        assert parse_devices('gpu:0,0') == [('gpu', 0), ('gpu', 0)]


def test_logged_train_output_is_the_global_batch_loss(caplog):
    """'Train net output' averages the replicas' losses, which divide by the global normalizer,
    so it equals the displayed iteration loss even with uneven splits and ignored labels."""
    import logging
    import re
    param = solver_param()
    param.display = 1
    solver = get_solver(param, devices='cpu:4')
    data = iter(batches(3))

    def source():
        batch = next(data)
        bounds = [0, 7, 7, 13, 16]
        return [{k: v[a:b] for k, v in batch.items()} for a, b in zip(bounds[:-1], bounds[1:])]

    solver.set_data_source(source)
    with caplog.at_level(logging.INFO):
        solver.step(3)
    solver.close()
    text = caplog.text
    shown = [float(x) for x in re.findall(r'Iteration \d+, loss = (\S+)', text)]
    outputs = [float(x) for x in re.findall(r'Train net output #0: loss = (\S+) ', text)]
    assert len(shown) == len(outputs) == 3
    np.testing.assert_allclose(outputs, shown, rtol=1e-5)


MEMORY_NET = '''layer { name: "d" type: "MemoryData" top: "data" top: "label"
  memory_data_param { batch_size: %d channels: 3 height: 2 width: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }'''


def test_memory_data_feeds_every_replica_from_the_arrays_set_on_the_net():
    """MemoryData is read when its batch is due, not ahead, so the arrays set between steps
    count: 2 devices of 3 rows train as 1 device of 6 on the same arrays."""
    weights = {}
    for devices, batch in (('cpu:2', 3), ('cpu:1', 6)):
        param = parse_text('base_lr: 0.5 lr_policy: "fixed" random_seed: 1 display: 0',
                           caffe_pb2.SolverParameter())
        param.net_param.CopyFrom(parse_text(MEMORY_NET % batch, caffe_pb2.NetParameter()))
        solver = get_solver(param, devices=devices, dtype=np.float64)
        try:
            for step in range(3):
                rows = np.random.RandomState(step).standard_normal((12, 3, 2, 2))
                solver.net.set_input_arrays(rows, (rows[:, 0, 0, 0] > 0).astype(float))
                solver.step(1)
            weights[devices] = to_numpy(solver.net.params['ip'][0].data).copy()
        finally:
            solver.close()
    np.testing.assert_allclose(weights['cpu:2'], weights['cpu:1'], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('mode', ['sync', 'async'])
@pytest.mark.parametrize('release', ['with', 'del'])
def test_a_solver_leaves_no_threads_behind(tmp_path, release, mode):
    """Replica threads, communicator helpers, the input pipeline's prefetch threads (and the
    asynchronous replicas' loops) end after a ``with`` block, and when a solver dropped
    without close() is collected."""
    import gc

    from test_train_net import make_job
    path = str(make_job(tmp_path / 'job', 2))
    baseline = threading.active_count()
    solver = get_solver(path, devices='cpu:4', mode=mode)
    solver.step(1)
    assert threading.active_count() > baseline
    if release == 'with':
        with solver:
            solver.step(1)
    del solver
    gc.collect()
    # threads end a moment after they are told to; one that never does is a hang
    watchdog.wait_until(lambda: threading.active_count() <= baseline,
                        "the solver's threads to end")
