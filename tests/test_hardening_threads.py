"""One caller at a time (issue 34, item 3): a solver's step() called from a second thread
while the first is in it, and a second pass on a Net that runs one, are one CaffeError
naming both threads; the first call goes on and its replicas stay equal.

Each test holds the first call inside a pass with an Event, so that the second call comes
while it is there, whatever the speed of the machine (the waits have generous bounds)."""
import threading

import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.netparam.prototxt import parse_text

BOUND = 300          # seconds: only a hang reaches it


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
            assert self.release.wait(BOUND)

    def _run(self, call):
        try:
            call()
        except BaseException as exc:
            self.error = exc

    def __enter__(self):
        self.thread.start()
        assert self.inside.wait(BOUND), 'the first call never got inside'
        return self

    def __exit__(self, *exc_info):
        self.release.set()
        self.thread.join(BOUND)
        assert not self.thread.is_alive()


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
