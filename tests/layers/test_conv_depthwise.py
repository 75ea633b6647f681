"""Depthwise Convolution and Deconvolution on the host (layers/conv/host_depthwise.py): against
the grouped GEMMs of im2col in float64, where any difference is a bug, not rounding;
finite-difference gradients; results that do not depend on the thread count; in place;
and which layers it runs."""
import numpy as np
import pytest

from caffe_syncbn.backend import cpu_threads
from caffe_syncbn.testing import build_layer, check_gradient
from helpers.arrays import randn

KINDS = ['Convolution', 'Deconvolution']
# (convolution_param but num_output and group, which are the channels; input shape):
# kernels 1x5, 3x1, 2, 3, 4 and 5; strides 1, 2 and 3; pads; dilation; bias on and off
SHAPES = [('kernel_size: 3 pad: 1', (2, 5, 7, 6)),
          ('kernel_size: 3 stride: 2', (3, 3, 9, 8)),
          ('kernel_h: 1 kernel_w: 5 pad_w: 2 dilation: 2', (1, 4, 5, 11)),
          ('kernel_size: 5 pad: 2 stride: 3 bias_term: false', (2, 7, 13, 10)),
          ('kernel_size: 4 stride: 2 pad: 1', (2, 3, 5, 6)),    # 2x bilinear upsampling's
          ('kernel_size: 2 stride: 2 bias_term: false', (1, 4, 4, 5)),
          ('kernel_size: 3 stride: 2 pad: 2 dilation: 2', (2, 3, 6, 7)),
          ('kernel_size: 3 dilation: 2', (2, 3, 7, 8)),
          ('kernel_h: 3 kernel_w: 1 stride_h: 2 stride_w: 1 bias_term: false', (1, 4, 7, 5))]
# (bottoms propagated to, the weight gradient wanted) for a layer of two bottoms
PROPAGATION = [((True, True), True), ((False, True), True), ((True, False), False),
               ((False, False), True)]


@pytest.fixture
def small_blocks(threads, monkeypatch):
    """conftest's thread counts, with blocks of a plane or two."""
    monkeypatch.setattr(cpu_threads, 'BLOCK_BYTES', 256)
    monkeypatch.setattr(cpu_threads, 'PARALLEL_MIN_ELEMENTS', 1)
    return threads


def _text(kind, body, channels, bottoms=1):
    links = ''.join('bottom: "x%d" top: "y%d" ' % (i, i) for i in range(bottoms))
    return ('name: "d" type: "%s" %s convolution_param { num_output: %d group: %d %s '
            'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "uniform" '
            'min: -0.5 max: 0.5 } }' % (kind, links, channels, channels, body))


def _run(text, shape, propagate_down=(True, True), weight_gradient=True, dtype=np.float64,
         depthwise=True):
    """The tops, the bottoms' diffs and the params' diffs of one pass over two bottoms, by
    the depthwise passes or (``depthwise`` False) by im2col and the grouped GEMMs."""
    layer, bottom, top = build_layer(text, [randn(*shape, seed=i) for i in range(2)],
                                     dtype=dtype)
    assert layer.depthwise            # the layer's own choice
    layer.depthwise = depthwise
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = randn(*blob.shape, seed=3 + i)
    layer.forward(bottom, top)
    for i, t in enumerate(top):
        t.diff[...] = randn(*t.shape, seed=4 + i)
    for blob in layer.blobs + bottom:
        blob.diff[...] = 1.0            # param diffs accumulate; unpropagated ones stay
    layer.param_propagate_down = [weight_gradient, True]
    layer.backward(top, list(propagate_down), bottom)
    return [blob.data for blob in top] + [blob.diff for blob in bottom + layer.blobs]


@pytest.mark.parametrize('propagate_down, weight_gradient', PROPAGATION)
@pytest.mark.parametrize('body, shape', SHAPES)
@pytest.mark.parametrize('kind', KINDS)
def test_depthwise_passes_match_the_grouped_gemms(kind, body, shape, propagate_down,
                                                  weight_gradient, small_blocks):
    text = _text(kind, body, shape[1], bottoms=2)
    expected = _run(text, shape, propagate_down, weight_gradient, depthwise=False)
    for a, b in zip(_run(text, shape, propagate_down, weight_gradient), expected):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('body, shape', SHAPES[1:])
@pytest.mark.parametrize('kind', KINDS)
def test_depthwise_gradients(kind, body, shape):
    check_gradient(_text(kind, body, shape[1]), [randn(*shape)])


@pytest.mark.parametrize('kind', KINDS)
def test_depthwise_gradients_of_two_bottoms(kind):
    check_gradient(_text(kind, SHAPES[0][0], 3, bottoms=2), [randn(2, 3, 4, 5),
                                                             randn(2, 3, 4, 5, seed=1)])


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('kind', KINDS)
def test_depthwise_results_do_not_depend_on_the_threads(kind, dtype, monkeypatch):
    """The blocks and the order their weight-gradient sums are added in follow the shape."""
    monkeypatch.setattr(cpu_threads, 'BLOCK_BYTES', 4000)  # blocks of 2 to 4 planes
    monkeypatch.setattr(cpu_threads, 'PARALLEL_MIN_ELEMENTS', 1)
    text = _text(kind, SHAPES[4][0], 5, bottoms=2)
    before, runs = cpu_threads.threads(), []
    try:
        for count in (1, 2, 3, 3, 2):
            cpu_threads.set_threads(count)
            runs.append(_run(text, (4, 5, 6, 7), dtype=dtype))
    finally:
        cpu_threads.set_threads(before)
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize('kind', KINDS)
def test_layers_that_are_not_depthwise_keep_the_gemms(kind):
    for body, shape in (('num_output: 8 kernel_size: 3 group: 4', (1, 4, 5, 5)),
                        ('num_output: 4 kernel_size: 3', (1, 4, 5, 5)),
                        ('num_output: 4 group: 4 kernel_size: 3', (1, 4, 5, 5, 5))):    # 3-D
        layer, _, _ = build_layer('name: "d" type: "%s" bottom: "x" top: "y" '
                                  'convolution_param { %s }' % (kind, body), [randn(*shape)])
        assert not layer.depthwise


@pytest.mark.parametrize('kind', KINDS)
def test_depthwise_layers_in_place(kind, monkeypatch):
    """Top and bottom one blob (a stride-1 layer that keeps the shape): the passes read
    each block of the input and of the top diff before they write over it. (The weight
    gradient then reads the top as the input, as Caffe's does.)"""
    monkeypatch.setattr(cpu_threads, 'BLOCK_BYTES', 256)
    text = _text(kind, 'kernel_size: 3 pad: 1', 3)
    results = []
    for in_place in (False, True):
        layer, bottom, top = build_layer(text, [randn(2, 3, 5, 4)])
        for i, blob in enumerate(layer.blobs):
            blob.data[...] = randn(*blob.shape, seed=3 + i)
        top = bottom if in_place else top
        layer.forward(bottom, top)
        results.append(top[0].data.copy())
        top[0].diff[...] = randn(2, 3, 5, 4, seed=1)
        layer.backward(top, [True], bottom)
        results.append(bottom[0].diff.copy())
    for got, want in zip(results[2:], results[:2]):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
