"""Bayesian SegNet's Dropout (sample_weights_test: true): in TEST it drops and scales as
SegNet's dropout_layer.cpp does in TRAIN, a new mask each forward, and its backward uses
that forward's mask; without the setting TEST is the identity."""
import numpy as np

from caffe_syncbn.layer import TEST
from caffe_syncbn.testing import build_layer

TEXT = ('name: "drop" type: "Dropout" bottom: "x" top: "y" dropout_param { dropout_ratio: 0.25 '
        '%s }')


def test_test_phase_samples_a_mask_each_forward():
    x = np.random.RandomState(0).uniform(1, 2, (4, 500))
    layer, bottom, top = build_layer(TEXT % 'sample_weights_test: true', [x], phase=TEST)
    masks = []
    for _ in range(2):
        layer.forward(bottom, top)
        kept = top[0].data != 0
        np.testing.assert_allclose(top[0].data[kept], x[kept] / 0.75, rtol=1e-12)
        assert abs(kept.mean() - 0.75) < 0.03
        masks.append(kept)
        top[0].diff[...] = 1
        layer.backward(top, [True], bottom)
        np.testing.assert_allclose(bottom[0].diff, kept / 0.75, rtol=1e-12)
    assert (masks[0] != masks[1]).any()


def test_without_it_test_phase_is_the_identity():
    x = np.random.RandomState(1).uniform(1, 2, (3, 50))
    layer, bottom, top = build_layer(TEXT % '', [x], phase=TEST)
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data, x)
