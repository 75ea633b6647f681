"""Corpus deploy nets with random weights that keep a deep net's activations in range, and
the tolerance their exports are held to.

Plain random weights make a 50-layer net's activations blow up or vanish, and a softmax
saturate to one-hot, so two implementations "agree" whatever they compute. Here weights are
fan-in scaled, and every batch norm gets statistics from its actual input (``calibrate``).
"""
import numpy as np

import caffe_syncbn as caffe
from caffe_syncbn.netparam.upgrade import load_net_param

from helpers.paths import CORPUS, require

BATCH_NORMS = ('BatchNorm', 'BN', 'SyncBN')


def fan_in(layer):
    shape = layer.blobs[0].shape
    if layer.type == 'InnerProduct':
        return layer.inputs
    if layer.type == 'Deconvolution':     # each output sees C_in/group * (k/stride)^d inputs
        return shape[0] // layer.group * np.prod(layer.kernel) / np.prod(layer.stride)
    return np.prod(shape[1:])


def random_weights(net, rng):
    """Fan-in scaled weights, small biases, Scale gammas near 1; written into ``net`` and
    returned as {layer: arrays}. Batch norms are left to calibrate()."""
    weights = {}
    for name, layer in zip(net._layer_names, net.layers):
        shapes = [b.shape for b in layer.blobs]
        if not shapes or layer.type in BATCH_NORMS:
            continue
        if layer.type == 'Scale':
            values = [rng.uniform(0.8, 1.2, shapes[0])] + \
                [rng.normal(0, 0.1, s) for s in shapes[1:]]
        else:
            # uniform with He's variance 2 / fan-in (uniform draws are the cheaper ones)
            bound = np.float32(np.sqrt(6.0 / fan_in(layer)))
            weight = rng.random(shapes[0], np.float32)
            weight -= np.float32(0.5)
            weight *= 2 * bound
            values = [weight] + [rng.normal(0, 0.05, s) for s in shapes[1:]]
        weights[name] = [np.asarray(v, np.float32) for v in values]
        for blob, value in zip(layer.blobs, weights[name]):
            blob.data[...] = value
    return weights


def calibrate(net, weights, rng):
    """Run ``net`` layer by layer, giving each batch norm statistics from its actual input,
    so that 100+ of them keep activations in range, yet unlike them: variances scaled by
    0.8..1.25 (plus a floor), BatchNorm scale factors in 0.5..2 (not 1), and means that
    remove only up to a tenth of the input's mean, plus 0.2 std of noise. Removing all of
    it would cancel the large positive mean that ReLU leaves at every layer, and that
    cancellation amplifies float32 rounding (about 1.2x per layer): after PSPNet's 100
    layers two float32 implementations would differ by 1e-4 of the output's range, ours
    from float64 too. Returns the net's outputs."""
    for i, (name, layer) in enumerate(zip(net._layer_names, net.layers)):
        if layer.type in BATCH_NORMS:
            x = np.asarray(net.blobs[net.bottom_names[name][0]].data)
            axes = (0,) + tuple(range(2, x.ndim))
            mean, var = x.mean(axis=axes), x.var(axis=axes)
            std = np.sqrt(var)
            mean = mean * rng.uniform(0, 0.1, mean.shape) + std * rng.normal(0, 0.2, mean.shape)
            # the floor: one value per channel (PSPNet's 1x1 pyramid bin) has no variance
            var = var * rng.uniform(0.8, 1.25, var.shape) + 0.1 * np.mean(x * x)
            if layer.type == 'BatchNorm':       # mean sum, variance sum, scale factor
                s = rng.uniform(0.5, 2.0)
                values = [s * mean, s * var, [s]]
            else:                               # slope, bias, running mean, running var
                values = [rng.uniform(0.8, 1.2, mean.shape), rng.normal(0, 0.1, mean.shape),
                          mean, var]
            weights[name] = [np.asarray(v, np.float32).reshape(b.shape)
                             for v, b in zip(values, layer.blobs)]
            for blob, value in zip(layer.blobs, weights[name]):
                blob.data[...] = value
        net.forward_prefilled(i, i)
    return {k: np.array(net.blobs[k].data) for k in net.outputs}


def assert_export_close(actual, expected, what):
    """The tolerance exports are held to: 1e-4 relative plus 1e-5 x max|expected| absolute.
    The outputs must not be constant, or the comparison would prove nothing."""
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, '%s: shape %s, expected %s' % (
        what, actual.shape, expected.shape)
    scale = float(np.abs(expected).max())
    assert np.ptp(expected) > 1e-6 * scale > 0, '%s is constant: weights too large or small' % what
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * scale, err_msg=what)


def worst_error(actual, expected):
    """(max absolute error, that error relative to max|expected|), for reports."""
    diff = float(np.abs(np.asarray(actual, np.float64) - expected).max())
    return diff, diff / max(float(np.abs(expected).max()), 1e-30)


class Deployed:
    """A corpus deploy net with random weights, an input, and our forward: the reference.

    ``input_shape`` replaces the prototxt's input shape (``input_shapes`` says so to
    to_onnx)."""

    def __init__(self, name, input_shape=None, seed=0):
        require(CORPUS / name)
        self.param = load_net_param(CORPUS / name)
        source = next(lp for lp in self.param.layer if lp.type == 'Input')
        self.input = source.top[0]
        self.input_shapes = None
        if input_shape is not None:
            self.input_shapes = {self.input: input_shape}
            del source.input_param.shape[0].dim[:]
            source.input_param.shape[0].dim.extend(input_shape)
        net = caffe.Net(self.param, caffe.TEST)
        rng = np.random.default_rng(seed)
        self.weights = random_weights(net, rng)
        self.x = rng.uniform(-1, 1, net.blobs[self.input].shape).astype(np.float32)
        net.blobs[self.input].data[...] = self.x
        self.expected = calibrate(net, self.weights, rng)
        self.net = net

    def forward(self, param, weights):
        """Our outputs of another net (a conversion of this one) on the same input."""
        net = caffe.Net(param, caffe.TEST, weights=weights)
        net.forward(**{self.input: self.x})
        return {name: net.blobs[name].data.copy() for name in self.expected}

    def check(self, outputs, what):
        assert sorted(outputs) == sorted(self.expected), what
        for blob, value in outputs.items():
            assert_export_close(value, self.expected[blob], '%s: %s' % (what, blob))

