"""Test helpers shared by every layer test: the gradient checker.

``check_gradient`` works as Caffe's GradientChecker does: it compares the analytic
gradient of ``sum_t(weights_t * top_t)`` with central finite differences, in float64.
"""
import numpy as np
from google.protobuf import text_format

from . import caffe_pb2
from .blob import Blob
from .layer import TRAIN, LayerContext, create_layer


def layer_param(text):
    """A LayerParameter from prototxt text (the body of one ``layer { ... }``)."""
    if isinstance(text, caffe_pb2.LayerParameter):
        return text
    return text_format.Parse(text, caffe_pb2.LayerParameter())


def build_layer(param, bottoms, phase=TRAIN, dtype=np.float64, seed=0):
    """Create, set up and reshape a layer on numpy blobs holding ``bottoms``."""
    param = layer_param(param)
    ctx = LayerContext(phase=phase, dtype=dtype, rng=np.random.RandomState(seed))
    layer = create_layer(param, ctx)
    bottom = []
    for array in bottoms:
        blob = Blob(np.shape(array), dtype)
        blob.data[...] = array
        bottom.append(blob)
    top = [Blob((), dtype) for _ in param.top]   # never in place: the checker perturbs bottoms
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    return layer, bottom, top


def numeric_gradient(array, objective, step=1e-6):
    """Central differences of ``objective()`` with respect to every element of ``array``
    (changed in place and restored), as a float64 array of its shape."""
    flat, grad = array.reshape(-1), np.zeros(array.size)
    for k in range(flat.size):
        saved = flat[k]
        flat[k] = saved + step
        plus = objective()
        flat[k] = saved - step
        minus = objective()
        flat[k] = saved
        grad[k] = (plus - minus) / (2 * step)
    return grad.reshape(array.shape)


def check_gradient(param, bottoms, check_bottom=None, check_params=True, phase=TRAIN,
                   step=1e-6, tolerance=1e-6, seed=1701, top_weights=None):
    """Assert analytic == numeric gradients for ``bottoms[i]`` (i in check_bottom) and params.

    Errors are relative: ``|a - n| <= tolerance * max(1, |a|, |n|)``.
    Returns the largest error seen, so a test can report it.
    """
    layer, bottom, top = build_layer(param, bottoms, phase=phase, seed=seed)
    if check_bottom is None:
        check_bottom = range(len(bottom))
    check_bottom = list(check_bottom)
    rs = np.random.RandomState(seed)

    def forward():
        layer.ctx.rng.seed(seed)          # random layers (dropout) draw the same mask each time
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
        return [t.data.copy() for t in top]

    outputs = forward()
    if top_weights is None:
        top_weights = [rs.standard_normal(o.shape) for o in outputs]

    def objective():
        return sum(float(np.sum(w * o)) for w, o in zip(top_weights, forward()))

    forward()
    for t, w in zip(top, top_weights):
        t.diff[...] = w
    for b in layer.blobs:
        b.diff[...] = 0
    layer.backward(top, [i in check_bottom for i in range(len(bottom))], bottom)
    analytic = [(('bottom', i), bottom[i].diff.copy()) for i in check_bottom]
    if check_params:
        analytic += [(('param', j), b.diff.copy()) for j, b in enumerate(layer.blobs)
                     if j >= len(layer.param_propagate_down) or layer.param_propagate_down[j]]

    worst = 0.0
    for (kind, index), grad in analytic:
        target = bottom[index] if kind == 'bottom' else layer.blobs[index]
        numerics = numeric_gradient(target.data, objective, step).reshape(-1)
        for k, (a, numeric) in enumerate(zip(grad.reshape(-1), numerics)):
            err = abs(a - numeric) / max(1.0, abs(a), abs(numeric))
            worst = max(worst, err)
            if err > tolerance:
                raise AssertionError(
                    '%s %d element %d of layer %s (%s): analytic %.10g vs numeric %.10g'
                    % (kind, index, k, layer.name, layer.type, a, numeric))
    return worst
