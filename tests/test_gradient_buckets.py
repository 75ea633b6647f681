"""Gradient buckets (caffe_syncbn/training/gradient_buckets.py): each starts as soon as backward has passed
its params' owners, the result does not depend on the bucket size, and iter_size works."""
import numpy as np
from helpers.counting_comm import CountingComm
from test_data_parallel import batches, solver_param, train

from caffe_syncbn import TRAIN, Net, caffe_pb2
from caffe_syncbn.comm import Communicator, ThreadComm
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.training import replicas, solvers, synchronous
from caffe_syncbn.training.gradient_buckets import GradientBuckets

SHARED = '''
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 6 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        param { name: "w" } inner_product_param { num_output: 6 bias_term: false
        weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "ip_mid" type: "InnerProduct" bottom: "ip1" top: "mid"
        inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "mid" top: "ip2"
        param { name: "w" } inner_product_param { num_output: 6 bias_term: false } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip2" bottom: "data" top: "loss" }
'''


class RecordingComm(Communicator):
    """One member alone; notes the sizes of the buffers it is asked to reduce, and when."""
    size = 1

    def __init__(self):
        self.started, self.layer = [], None

    def allreduce(self, array, tag=None):
        self.started.append((self.layer, array.size))
        return array


def test_a_bucket_starts_when_backward_has_passed_its_owner_layers():
    net = Net(parse_text(SHARED, caffe_pb2.NetParameter()), TRAIN)
    comm = RecordingComm()
    buckets = GradientBuckets(net, comm, bucket_bytes=1)        # one param per bucket
    names = list(net._layer_names)
    net.blobs['data'].data[...] = np.random.RandomState(0).standard_normal((4, 6))

    def after_layer(index):
        comm.layer = names[index]
        buckets.layer_done(index)

    net.forward_backward(after_layer=after_layer)
    buckets.finish()
    # ip_mid's weight and bias start once ip_mid is through; the shared 'w' only after ip1,
    # its owner, although ip2 (which also uses it) ran long before
    assert comm.started == [('ip_mid', 36), ('ip_mid', 6), ('ip1', 36)]


def test_the_bucket_size_does_not_change_the_result(monkeypatch):
    data = batches(4)
    monkeypatch.setattr(synchronous.Synchronous, 'gradient_bucket_bytes', 1)
    small, _ = train('cpu:4', data, (5, 4, 4, 3))
    monkeypatch.setattr(synchronous.Synchronous, 'gradient_bucket_bytes', 1 << 30)
    one, _ = train('cpu:4', data, (5, 4, 4, 3))
    for mine, theirs in zip(small[0], one[0]):
        assert np.array_equal(mine, theirs)


def test_gradients_are_reduced_while_backward_goes_on(monkeypatch):
    """With small buckets, the InnerProduct's gradients leave before the SyncBN layer below it
    makes its backward allreduce."""
    comms = []

    def counting(devices, link=None):
        comms[:] = [CountingComm(c) for c in ThreadComm.create(len(devices))]
        return comms

    monkeypatch.setattr(replicas, 'communicators', counting)
    monkeypatch.setattr(synchronous.Synchronous, 'gradient_bucket_bytes', 1)
    solver = solvers.get_solver(solver_param(), devices='cpu:2')
    data = iter(batches(1))
    solver.set_data_source(lambda: next(data))
    comms[0].reset()
    solver.step(1)
    solver.close()
    calls = [call for call in comms[0].calls if call[1] in ('bn', 'gradients')]
    bn_forward, bn_backward = [i for i, call in enumerate(calls) if call == ('allreduce', 'bn')]
    first_gradients = calls.index(('allreduce_async', 'gradients'))
    assert bn_forward < first_gradients < bn_backward, calls
    assert calls.count(('allreduce_async', 'gradients')) == 6      # conv w, b; bn slope, bias; ip w, b


def test_iter_size_accumulates_before_reducing():
    param = solver_param()
    param.iter_size = 2
    data = batches(6, seed=4)
    single = solvers.get_solver(param, devices='cpu:1')
    multi = solvers.get_solver(param, devices='cpu:2')
    for solver in (single, multi):
        feed = iter(data)
        solver.set_data_source(lambda feed=feed: next(feed))
        solver.step(3)
    for a, b in zip(single.net.learnable_params, multi.net.learnable_params):
        np.testing.assert_allclose(a.data, b.data, atol=1e-5, rtol=1e-5)
    single.close()
    multi.close()
