"""The GPU path on the CPU emulation of the CUDA runtime (emulated_gpu.py): every golden
case of BVLC Caffe in GPU mode, data-parallel training on gpu:0,0 equal to cpu:2, every
hand-over between the solver's thread and the replicas' streams ordered, and a training
iteration that reads the device a bounded number of times, whatever the depth of the net."""
import numpy as np
import pytest
from helpers.emulated_gpu import StreamOrder, UnorderedAccess, emulated_gpu
from test_data_parallel import NET, SOLVER, batches, max_difference, solver_param, train
from test_golden_nets import cases, run_case

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.backend import to_numpy
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.training.solvers import get_solver


# ---- the emulation has teeth -------------------------------------------------------------------
def test_a_read_on_another_stream_needs_a_synchronize_or_an_event():
    order = StreamOrder()
    replica, main = order.new_stream(0, 'replica'), order.null_stream(0)
    memory = object.__new__(type('Root', (), {}))
    order.access(memory, replica, True, 'a blob')
    with pytest.raises(UnorderedAccess, match="read of a blob on stream 'null stream of gpu:0' "
                                              "is not ordered after its write on stream "
                                              "'replica'"):
        order.access(memory, main, False, 'a blob')
    order.synchronize(replica)                      # the host waits for the replica's stream
    order.access(memory, main, False, 'a blob')
    order.access(memory, replica, False, 'a blob')  # two readers: no conflict
    with pytest.raises(UnorderedAccess, match='write of a blob'):
        order.access(memory, replica, True, 'a blob')   # the main stream's read may be late
    order.wait_event(replica, order.record_event(main))
    order.access(memory, replica, True, 'a blob')


def test_device_arrays_do_not_mix_with_host_arrays(monkeypatch):
    xp = emulated_gpu(monkeypatch).module
    a = xp.arange(4.0)
    with pytest.raises(TypeError, match='does not turn into a numpy array'):
        np.asarray(a)
    with pytest.raises(TypeError, match='numpy array'):
        a + np.ones(4)
    assert float((a * 2).sum()) == 12.0 and isinstance(a[1:], xp.ndarray)
    np.testing.assert_array_equal(to_numpy(xp.exp(a)), np.exp(np.arange(4.0)))


# ---- nets and training ------------------------------------------------------------------------------
@pytest.fixture
def gpu(monkeypatch):
    return emulated_gpu(monkeypatch)


@pytest.fixture
def gpu_mode(gpu):
    caffe.set_mode_gpu()
    yield gpu
    caffe.set_mode_cpu()


@pytest.mark.parametrize('name', cases())
def test_golden_case_in_gpu_mode(name, monkeypatch, gpu_mode):
    run_case(name, monkeypatch)


@pytest.mark.parametrize('devices', ['gpu:0,0', 'gpu:0,1', 'gpu:1'])
def test_training_on_emulated_gpus_equals_the_cpu(gpu, devices):
    data = batches(3)
    cpu, cpu_stats = train('cpu:2' if ',' in devices else 'cpu:1', data)
    emulated, emulated_stats = train(devices, data)
    assert max_difference(cpu[0], emulated[0]) <= 1e-5
    assert max_difference(cpu_stats[0], emulated_stats[0]) <= 1e-5


def test_asynchronous_replicas_hand_their_gradients_over_in_order(gpu):
    """Each replica's thread updates the one parameter holder on its own stream: the
    holder's reads (to_numpy, which waits for the stream) order the next replica's work."""
    data = batches(12)
    count = iter(range(100))
    with get_solver(solver_param('BN'), devices='gpu:0,0', mode='async') as solver:
        before = to_numpy(solver.net.learnable_params[0].data).copy()
        solver.set_data_source(lambda: {k: v[:8] for k, v in data[next(count) % 12].items()})
        solver.step(3)
        after = to_numpy(solver.net.learnable_params[0].data)
    assert np.isfinite(after).all() and not np.array_equal(before, after)


def solver_with_test_net(tmp_path):
    param = parse_text(SOLVER, caffe_pb2.SolverParameter())
    net = parse_text(NET % {'bn': 'BatchNorm'}, caffe_pb2.NetParameter())
    param.net_param.CopyFrom(net)
    param.test_net_param.add().CopyFrom(net)
    param.test_iter.append(1)
    param.test_interval, param.display = 2, 1
    param.snapshot_prefix = str(tmp_path / 'emulated')
    return param


def test_every_hand_over_between_the_solver_and_the_replicas_is_ordered(gpu, tmp_path):
    """Weights loaded by the solver, Input blobs fed, the display's outputs, the test net,
    snapshots and a restore, on replicas of GPU 1 (the solver's thread has GPU 0 current)
    with the emulation's strict streams: any unordered access raises UnorderedAccess, an
    operation on another GPU's array a ValueError."""
    reference = caffe.Net(parse_text(NET % {'bn': 'BatchNorm'}, caffe_pb2.NetParameter()),
                          caffe.TRAIN)
    reference.save(str(tmp_path / 'init.caffemodel'))
    param = solver_with_test_net(tmp_path)
    data = iter(batches(8))
    with get_solver(param, devices='gpu:1,1', weights=[str(tmp_path / 'init.caffemodel')]) \
            as solver:
        solver.set_data_source(lambda: next(data))
        solver.set_data_source(lambda: batches(1, seed=9)[0], test_net=0)
        solver.step(3)
        _, state = solver.snapshot()
        after = [to_numpy(b.data).copy() for b in solver.net.learnable_params]
        solver.step(1)
        solver.restore(state)
        np.testing.assert_array_equal(to_numpy(solver.net.learnable_params[0].data), after[0])
        solver.step(1)
        for name in ('conv', 'ip'):          # learned, so equal on every replica
            for mine, root in zip(solver.replicas[1].params[name], solver.net.params[name]):
                np.testing.assert_array_equal(to_numpy(mine.data), to_numpy(root.data))


# ---- reads of the device -------------------------------------------------------------------------
def chained_net(blocks):
    """``blocks`` conv + BatchNorm + Scale + leaky ReLU, then InnerProduct and a
    SoftmaxWithLoss whose labels include ignored ones: inplace_abn absorbs each chain, and
    the chains' backward may find x_hat from their output (a leaky ReLU keeps its sign)."""
    layers = ['layer { name: "data" type: "Input" top: "data" top: "label" input_param { '
              'shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }']
    bottom = 'data'
    for k in range(blocks):
        layers += ['layer { name: "conv%d" type: "Convolution" bottom: "%s" top: "c%d" '
                   'convolution_param { num_output: 4 kernel_size: 3 pad: 1 '
                   'weight_filler { type: "xavier" } } }' % (k, bottom, k),
                   'layer { name: "bn%d" type: "BatchNorm" bottom: "c%d" top: "c%d" }' % (k, k, k),
                   'layer { name: "scale%d" type: "Scale" bottom: "c%d" top: "c%d" '
                   'scale_param { bias_term: true } }' % (k, k, k),
                   'layer { name: "relu%d" type: "ReLU" bottom: "c%d" top: "c%d" '
                   'relu_param { negative_slope: 0.1 } }' % (k, k, k)]
        bottom = 'c%d' % k
    layers += ['layer { name: "ip" type: "InnerProduct" bottom: "%s" top: "ip" '
               'inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }' % bottom,
               'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" '
               'top: "loss" loss_param { ignore_label: 4 } }']
    param = parse_text(SOLVER, caffe_pb2.SolverParameter())
    param.net_param.CopyFrom(parse_text('\n'.join(layers), caffe_pb2.NetParameter()))
    return param


def reads_per_iteration(gpu, blocks, devices, precision='float32'):
    rs = np.random.RandomState(0)
    with get_solver(chained_net(blocks), devices=devices, memory_plan='inplace_abn',
                    sync_bn=True, precision=precision) as solver:
        solver.set_data_source(lambda: {'data': rs.standard_normal((4, 3, 6, 6)),
                                        'label': rs.randint(0, 5, 4).astype(float)})
        solver.step(2)                     # setup and first steps read what they read once
        before = gpu.order.host_reads
        solver.step(3)
        return (gpu.order.host_reads - before) / 3


def test_an_iteration_reads_the_device_once_per_replica_and_pass_whatever_the_depth(gpu):
    """Per replica, one read before the pass (whether each chain may find x_hat from its
    output) and one after it (the loss and the label checks), and one by the solver (the
    non-finite check of the gradients, the params and the running statistics, together): 5 for
    two replicas, with 2 chains or with 6."""
    assert reads_per_iteration(gpu, 2, 'gpu:0,0') == 5
    assert reads_per_iteration(gpu, 6, 'gpu:0,0') == 5


def test_a_float16_iteration_reads_the_device_as_often_with_its_loss_scale(gpu):
    """Mixed precision on the CUDA kernels: the loss scale's check of the gradients is the
    solver's one read, which it takes on every iteration (float32 stops reading once a
    value that is not finite was found); still 5 for two replicas, at any depth."""
    assert reads_per_iteration(gpu, 2, 'gpu:0,0', 'float16') == 5
    assert reads_per_iteration(gpu, 6, 'gpu:0,0', 'float16') == 5


def test_a_bad_label_on_a_gpu_is_still_one_line_naming_the_layer(gpu):
    with get_solver(chained_net(1), devices='gpu:0,0') as solver:
        solver.set_data_source(lambda: {'data': np.zeros((4, 3, 6, 6)),
                                        'label': np.array([0, 1, 7, 2.0])})
        with pytest.raises(caffe.CaffeError, match=r"layer 'loss'.*labels must lie in \[0, 5\) "
                                                   r"or equal ignore_label \(4\), got 7"):
            solver.step(1)
