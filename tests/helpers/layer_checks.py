"""Checks the layer tests share: inputs away from a function's kinks, and a layer run in
place (its top is its bottom's blob) against the same layer out of place."""
import numpy as np

from caffe_syncbn.fillers import set_random_seed
from caffe_syncbn.layer import TRAIN
from caffe_syncbn.testing import build_layer

RS = np.random.RandomState(7)


def away_from_zero(*shape, low=0.1):
    """Random values with |x| >= low, so no element sits on a kink."""
    return RS.uniform(low, 1.0, shape) * RS.choice([-1.0, 1.0], shape)


def positive(*shape, low=0.2, high=2.0):
    return RS.uniform(low, high, shape)


def forward(text, bottoms, phase=TRAIN, dtype=np.float64):
    layer, bottom, top = build_layer(text, bottoms, phase=phase, dtype=dtype)
    layer.forward(bottom, top)
    return layer, bottom, top


def _run(text, bottoms, in_place, seed=3):
    """Forward and backward once; in place, the top is bottom 0's blob."""
    set_random_seed(seed)   # the same filler values in both runs
    layer, bottom, top = build_layer("name: 'l' bottom: 'x' top: 'y' " + text, bottoms, seed=seed)
    if in_place:
        top = [bottom[0]]
        layer.reshape(bottom, top)
    weights = np.random.RandomState(seed).randn(*bottom[0].shape)
    layer.forward(bottom, top)
    output = top[0].data.copy()
    top[0].diff[...] = weights
    layer.backward(top, [True] * len(bottom), bottom)
    return output, [b.diff.copy() for b in bottom], [b.diff.copy() for b in layer.blobs]


def assert_in_place_matches_out_of_place(text, bottoms):
    expected = _run(text, bottoms, in_place=False)
    actual = _run(text, bottoms, in_place=True)
    np.testing.assert_allclose(actual[0], expected[0], rtol=1e-12)
    for a, e in zip(actual[1] + actual[2], expected[1] + expected[2]):
        np.testing.assert_allclose(a, e, rtol=1e-12)
