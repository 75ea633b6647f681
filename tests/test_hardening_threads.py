"""One caller at a time (issue 34, item 3): a solver's step() called from a second thread
while the first is in it, and a second pass on a Net that runs one, are one CaffeError
naming both threads; the first call goes on and its replicas stay equal.

Each test holds the first call inside a pass with an Event, so that the second call comes
while it is there, whatever the speed of the machine (the waits have generous bounds)."""
import threading

import numpy as np
import pytest
from helpers import watchdog
from test_data_parallel import batches, solver_param

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.backend import to_numpy
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.training.solvers import get_solver

LIMIT = 300          # CPU seconds the held work may take (helpers.watchdog)


class HeldCall:
    """Runs ``call`` in a thread of its own, held at its first ``hold()`` until released."""

    def __init__(self, call):
        self.inside, self.release = threading.Event(), threading.Event()
        self.error = None
        self._holds = 0
        self.thread = threading.Thread(target=self._run, args=(call,), name='first-caller')

    def hold(self):
        self._holds += 1
        if self._holds == 1:
            self.inside.set()
            self.release.wait()          # __exit__ sets it, whatever happens

    def _run(self, call):
        try:
            call()
        except BaseException as exc:
            self.error = exc

    def __enter__(self):
        self.thread.start()
        watchdog.wait_until(self.inside.is_set, 'the first call getting inside', LIMIT)
        return self

    def __exit__(self, *exc_info):
        self.release.set()
        watchdog.join([self.thread], 'the first call', LIMIT)


def test_step_from_a_second_thread_is_one_error_and_the_replicas_stay_equal():
    data = batches(6)
    with get_solver(solver_param('BatchNorm'), devices='cpu:4') as solver:
        fed = iter(range(100))
        held = HeldCall(lambda: solver.step(3))

        def source():
            held.hold()
            return data[next(fed) % len(data)]
        solver.set_data_source(source)
        with held:
            with pytest.raises(caffe.CaffeError) as info:
                solver.step(3)
        assert held.error is None
        message = str(info.value)
        assert message == ("the solver: step() in thread 'MainThread' while thread "
                           "'first-caller' is in step(): a solver takes one step at a time (its "
                           'replicas take every step together); call it from one thread'), message
        assert solver.iter == 3
        solver.step(1)                       # the guard is free again
        assert solver.iter == 4
        learned = [i for i, lr in enumerate(solver.net.params_lr) if lr]   # not statistics
        for replica in solver.replicas[1:]:
            for i in learned:
                np.testing.assert_array_equal(to_numpy(replica.learnable_params[i].data),
                                              to_numpy(solver.net.learnable_params[i].data))


def test_snapshot_from_a_second_thread_during_a_step_is_one_error(tmp_path):
    param = solver_param('BatchNorm')
    param.snapshot_prefix = str(tmp_path / 'snap')
    solver = caffe.get_solver(param)
    data = batches(2)
    held = HeldCall(lambda: solver.step(1))
    solver.set_data_source(lambda: (held.hold(), data[0])[1])
    with held:
        with pytest.raises(caffe.CaffeError, match=r"the solver: snapshot\(\) in thread "
                                                   r"'MainThread' while thread 'first-caller' "
                                                   r'is in step\(\)'):
            solver.snapshot()
    assert held.error is None and not list(tmp_path.iterdir())


class HoldingLayer(caffe.Layer):
    """Passes its bottom through; its forward calls ``HoldingLayer.hold``."""
    hold = None

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        HoldingLayer.hold()
        top[0].data[...] = bottom[0].data * 2

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = top[0].diff * 2


NET = '''name: "shared"
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "hold" type: "Python" bottom: "x" top: "y"
        python_param { module: "test_hardening_threads" layer: "HoldingLayer" } }
layer { name: "ip" type: "InnerProduct" bottom: "y" top: "z"
        inner_product_param { num_output: 2 weight_filler { type: "xavier" } } }
'''


@pytest.mark.parametrize('second', ['forward', 'backward', 'forward_backward'])
def test_a_second_pass_on_a_net_that_runs_one_is_one_error(monkeypatch, second):
    """A Net's blobs hold one batch: a pass from another thread meanwhile would mix two
    (the issue: 40 wrong outputs in 400). It is refused; the first pass's outputs are
    its own."""
    net = caffe.Net(parse_text(NET, caffe_pb2.NetParameter()), caffe.TRAIN)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    outputs = {}
    held = HeldCall(lambda: outputs.update(net.forward(x=x)))
    monkeypatch.setattr(HoldingLayer, 'hold', held.hold)
    with held:
        with pytest.raises(caffe.CaffeError) as info:
            {'forward': lambda: net.forward(x=x + 1), 'backward': net.backward,
             'forward_backward': net.forward_backward}[second]()
    assert held.error is None
    assert str(info.value) == (
        "net 'shared': %s() in thread 'MainThread' while thread 'first-caller' is in "
        "forward(): a Net runs one pass at a time, its blobs holding one batch, as in Caffe; "
        'give each thread a Net of its own, sharing the weights (share_with)'
        % {'forward': 'forward', 'backward': 'backward',
           'forward_backward': 'forward_backward'}[second])
    w, b = (blob.data for blob in net.params['ip'])
    np.testing.assert_allclose(outputs['z'], (2 * x) @ w.T + b, rtol=1e-6)
