"""Random weights that keep a deep net's activations in range, for comparing implementations.

Plain random weights make a 50-layer net's activations blow up or vanish, and a softmax
saturate to one-hot, so two implementations "agree" whatever they compute. Here weights are
scaled by fan-in, and every batch norm's statistics are calibrated on the net's own input:
the mean and variance of what reaches it, then perturbed, so that normalization does real,
non-trivial work (BatchNorm also gets a scale factor other than 1). The variance is kept at
least a quarter of the squared mean: a channel that is constant on one image (a 1x1 pyramid
pooling bin at batch 1) would otherwise get a tiny variance, and y = a*x + c would cancel
catastrophically in any float32 implementation, which trained statistics never ask of it.
The last normalization of each residual branch (whose output an Eltwise reads) gets a small
slope, U(0.1, 0.4), as in trained residual nets: with every branch as large as the trunk,
float32 rounding grows block after block, and PSPNet-50's output lands 1e-4 away from the
float64 one in any float32 implementation, ours included.
"""
import numpy as np

NORMS = ('BatchNorm', 'BN', 'SyncBN')
BATCHNORM_FACTOR = 2.5


def _fan_in(shape, layer_type):
    if layer_type == 'Deconvolution':
        return max(1, shape[0] * int(np.prod(shape[2:])))
    return max(1, int(np.prod(shape[1:])))


def _slope(shape, rs, ends_branch):
    return rs.uniform(0.1, 0.4, shape) if ends_branch else rs.uniform(0.5, 1.5, shape)


def _fill(layer, rs, ends_branch):
    for j, blob in enumerate(layer.blobs):
        if layer.type in ('Convolution', 'Deconvolution', 'InnerProduct') and j == 0:
            std = 1.0 / np.sqrt(_fan_in(blob.shape, layer.type))
            if layer.type == 'InnerProduct' and layer.param.inner_product_param.transpose:
                std = 1.0 / np.sqrt(blob.shape[0])
            blob.data[...] = rs.standard_normal(blob.shape) * std
        elif layer.type == 'Scale' and j == 0:
            blob.data[...] = _slope(blob.shape, rs, ends_branch)
        else:
            blob.data[...] = rs.standard_normal(blob.shape) * 0.1


def _calibrate(layer, x, rs, ends_branch):
    axes = (0,) + tuple(range(2, x.ndim))
    mean = x.mean(axis=axes).astype(np.float64)
    var = x.var(axis=axes).astype(np.float64)
    var = var * rs.uniform(0.5, 2.0, var.shape) + (0.5 * mean) ** 2 + 1e-2
    mean = mean + rs.standard_normal(mean.shape) * 0.2 * np.sqrt(var)
    if layer.type == 'BatchNorm':
        values = [mean * BATCHNORM_FACTOR, var * BATCHNORM_FACTOR, [BATCHNORM_FACTOR]]
    else:
        values = [_slope(mean.shape, rs, ends_branch), rs.standard_normal(mean.shape) * 0.2,
                  mean, var]
    for blob, value in zip(layer.blobs, values):
        blob.data[...] = np.reshape(value, blob.shape)


def realistic_weights(net, inputs, seed=0):
    """Fill ``net`` (a TEST Net) and return {layer name: [arrays]}; ``inputs`` is
    {input blob: array}, on which the batch norms are calibrated."""
    rs = np.random.RandomState(seed)
    for name, value in inputs.items():
        net.blobs[name].reshape(value.shape)
        net.blobs[name].data[...] = value
    summed = {b for lp in net.net_param.layer if lp.type == 'Eltwise' for b in lp.bottom}
    for i, layer in enumerate(net.layers):
        ends_branch = layer.param.top[0] in summed if layer.param.top else False
        if layer.type in NORMS:
            _calibrate(layer, np.asarray(net._bottoms[i][0].data, np.float64), rs, ends_branch)
        else:
            _fill(layer, rs, ends_branch)
        net.forward_prefilled(i, i)
    return {name: [b.data.copy() for b in layer.blobs]
            for name, layer in zip(net._layer_names, net.layers) if layer.blobs}


def assert_close(actual, expected, what='', floor=0.0):
    """The tolerance the exports are held to: 1e-4 relative plus 1e-5 x max|expected|
    absolute, or ``floor`` absolute where that is larger. Against a float64 reference the
    floor is a few times our own float32 forward's error: on a 100-layer net float32
    rounding alone can exceed 1e-5 x max|expected|, and no float32 implementation does
    better than that."""
    expected = np.asarray(expected, np.float64)
    actual = np.asarray(actual, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=max(1e-5 * scale, floor),
                               err_msg=what)


def worst_error(actual, expected):
    """(max absolute error, that error relative to max|expected|), for reports."""
    diff = float(np.abs(np.asarray(actual, np.float64) - expected).max())
    return diff, diff / max(float(np.abs(expected).max()), 1e-30)
