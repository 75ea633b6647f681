"""Python layers for tests/test_net.py, imported through python_param from sys.path.

Every call is recorded in ``CALLS`` so a test can see which layers the Net ran backward on.
"""
import json

import caffe_syncbn as caffe

CALLS = []


class Multiply(caffe.Layer):
    """top = factor * bottom, with ``factor`` from a JSON param_str (default 1)."""

    def setup(self, bottom, top):
        self.factor = json.loads(self.param_str or '{}').get('factor', 1.0)
        CALLS.append(('setup', self.name))

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.factor * bottom[0].data
        CALLS.append(('forward', self.name))

    def backward(self, top, propagate_down, bottom):
        CALLS.append(('backward', self.name, list(propagate_down)))
        if propagate_down[0]:
            bottom[0].diff[...] = self.factor * top[0].diff


class SumSquares(caffe.Layer):
    """A loss written in Python: top = sum(bottom**2) / 2 (the prototxt gives loss_weight)."""

    def reshape(self, bottom, top):
        top[0].reshape()

    def forward(self, bottom, top):
        top[0].data[...] = (bottom[0].data ** 2).sum() / 2

    def backward(self, top, propagate_down, bottom):
        CALLS.append(('backward', self.name, list(propagate_down)))
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff * bottom[0].data
