"""R-FCN's PSROIPooling against a loop written from the fork's CUDA kernels (each bin edge
with one rounding of the fused multiply-add, in exact arithmetic), on every engine;
finite differences; one-line errors on bad input. OpenCV's PSROIPooling:
tests/test_fork_exports.py."""
import math
from fractions import Fraction

import numpy as np
import pytest

from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layers.pooling.psroi_pooling import bin_edges
from caffe_syncbn.testing import build_layer, check_gradient

RS = np.random.RandomState(11)


def to_float32(value):
    """The float32 nearest the exact ``value`` (a Fraction), ties to the even one."""
    guess = np.float32(float(value))
    near = [np.nextafter(guess, np.float32(-np.inf)), guess,
            np.nextafter(guess, np.float32(np.inf))]
    return min(near, key=lambda c: (abs(Fraction(float(c)) - value),
                                    int(np.array(c).view(np.int32)) & 1))


def c_round(value):
    """roundf: halves away from zero."""
    return math.copysign(math.floor(abs(float(value)) + 0.5), value)


def psroi_reference(x, rois, scale, output_dim, group):
    """The fork's PSROIPoolingForward in float32, cell by cell: (top, [(image, channel,
    h0, h1, w0, w1) per cell, or None where its bin is empty])."""
    f32 = np.float32
    scale = f32(scale)
    height, width = x.shape[2:]
    top = np.zeros((len(rois), output_dim, group, group))
    bins = []
    for r, roi in enumerate(np.asarray(rois, f32)):
        image = int(roi[0])
        start_w, start_h = f32(c_round(roi[1])) * scale, f32(c_round(roi[2])) * scale
        end_w, end_h = f32(c_round(roi[3]) + 1.0) * scale, f32(c_round(roi[4]) + 1.0) * scale
        roi_w, roi_h = f32(max(float(end_w - start_w), 0.1)), f32(max(float(end_h - start_h), 0.1))
        bin_w, bin_h = roi_w / f32(group), roi_h / f32(group)

        def edge(k, size, start, limit, rounding):
            fused = to_float32(Fraction(k) * Fraction(float(size)) + Fraction(float(start)))
            return min(max(rounding(fused), 0), limit)
        for ctop in range(output_dim):
            for ph in range(group):
                for pw in range(group):
                    h0 = edge(ph, bin_h, start_h, height, math.floor)
                    h1 = edge(ph + 1, bin_h, start_h, height, math.ceil)
                    w0 = edge(pw, bin_w, start_w, width, math.floor)
                    w1 = edge(pw + 1, bin_w, start_w, width, math.ceil)
                    channel = (ctop * group + ph) * group + pw
                    if h1 <= h0 or w1 <= w0:
                        bins.append(None)
                        continue
                    window = x[image, channel, h0:h1, w0:w1].astype(np.float64)
                    top[r, ctop, ph, pw] = window.sum() / window.size
                    bins.append((image, channel, h0, h1, w0, w1))
    return top, bins


def psroi_backward_reference(x_shape, dy, bins):
    dx = np.zeros(x_shape)
    for diff, cell in zip(dy.reshape(-1), bins):
        if cell is not None:
            image, channel, h0, h1, w0, w1 = cell
            dx[image, channel, h0:h1, w0:w1] += diff / ((h1 - h0) * (w1 - w0))
    return dx


PSROI = ('name: "ps" type: "PSROIPooling" bottom: "x" bottom: "rois" top: "y" '
         'psroi_pooling_param { spatial_scale: %s output_dim: %d group_size: %d }')

#: image coordinates for a 16x map stride (spatial_scale 0.0625) of a 6 x 7 map
ROIS = np.array([
    [0, -16.259412845377838, -16.259412845377838, 46.524418282583355, 46.524418282583355],
    [1, 2.5, 3.5, 40.5, 60.5],              # halves round away from zero
    [0, -30, -30, 200, 200],                # past every edge
    [1, 50, 40, 20, 10],                    # end before start: the extent of 0.1
    [0, 95, 100, 95, 100],                  # one cell at the border
    [1, 200, 200, 300, 300],                # outside the map: every bin empty
    [0.9, 10, 10, 60, 50],                  # the batch index truncates to 0
    [1, -5.5, 7.49, 33.51, 80],
])


@pytest.mark.parametrize('scale, output_dim, group, map_hw', [
    ('0.0625', 3, 3, (6, 7)),
    ('0.0625', 2, 7, (6, 7)),
    ('0.3333333', 1, 4, (20, 33)),
])
def test_psroi_pooling_matches_the_forks_kernels(engine, scale, output_dim, group, map_hw):
    x = RS.standard_normal((2, output_dim * group * group) + map_hw).astype(np.float32)
    text = PSROI % (scale, output_dim, group)
    expected, bins = psroi_reference(x, ROIS, float(scale), output_dim, group)
    dy = RS.standard_normal(expected.shape)
    result = engine.run(text, [x, ROIS], top_diffs=[dy], propagate_down=[True, False],
                        dtype=np.float32)
    np.testing.assert_allclose(result['top'][0], expected, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(result['bottom_diff'][0],
                               psroi_backward_reference(x.shape, dy, bins), rtol=2e-6, atol=1e-6)
    assert np.count_nonzero(result['top'][0]) < expected.size      # some bins are empty


def test_bin_edges_fuse_the_multiply_add_as_nvcc_does():
    """ROI 0 at scale 0.0625, group 7: the end of bin 6 is 7 * bin + start = 3.0000002 with
    one rounding (the kernel's fused multiply-add), 3 with two; its ceil is 4, not 3."""
    _, rows, cols = bin_edges(ROIS[:1], 0.0625, 7, 10, 10, np.float32)
    assert rows[1][0, 6] == 4 and cols[1][0, 6] == 4
    f32 = np.float32
    start = f32(-16) * f32(0.0625)
    size = (f32(47) * f32(0.0625) - start) / f32(7)
    assert math.ceil(f32(f32(7) * size) + start) == 3


def test_psroi_pooling_gradient(host_engine):
    x = RS.standard_normal((2, 8, 5, 6))
    rois = np.array([[0, 1, 2, 40, 30], [1, -8, 3, 17, 70], [1, 30, 20, 60, 60]])
    host_engine.check_gradient(PSROI % ('0.125', 2, 2), [x, rois], check_bottom=[0])
    check_gradient(PSROI % ('0.125', 2, 2), [x, rois], check_bottom=[0])


def test_the_rois_get_no_gradient():
    layer, _, _ = build_layer(PSROI % ('1', 1, 1), [np.zeros((1, 1, 3, 3)), np.zeros((1, 5))])
    assert layer.allow_force_backward(0) and not layer.allow_force_backward(1)


def error_line(text, bottoms, engine=None):
    with pytest.raises(CaffeError) as info:
        if engine is None:
            layer, bottom, top = build_layer(text, bottoms, dtype=np.float32)
            layer.forward(bottom, top)
        else:
            engine.run(text, bottoms, dtype=np.float32)
    message = str(info.value)
    assert '\n' not in message
    return message


@pytest.mark.parametrize('rois, message', [
    ([[2, 0, 0, 8, 8]], 'ROI 0 has batch index 2; bottom 0 holds 2 image(s)'),
    ([[0, 0, 0, 8, 8], [-1, 0, 0, 8, 8]], 'ROI 1 has batch index -1; bottom 0 holds 2 image(s)'),
    ([[0, 0, np.nan, 8, 8]], 'ROI 0 is not finite: [0.0, 0.0, nan, 8.0, 8.0]'),
])
def test_bad_rois_are_one_line_on_every_engine(engine, rois, message):
    x = np.zeros((2, 4, 3, 3), np.float32)
    line = error_line(PSROI % ('0.5', 1, 2), [x, np.array(rois, np.float32)], engine)
    assert line == "layer 'ps' (type PSROIPooling): " + message


@pytest.mark.parametrize('settings, x_shape, message', [
    ('spatial_scale: 0.5 output_dim: 2 group_size: 2', (1, 6, 3, 3),
     'bottom 0 has 6 channels; output_dim 2 x group_size 2^2 needs 8'),
    ('spatial_scale: 0.5 group_size: 2', (1, 4, 3, 3),
     'psroi_pooling_param needs output_dim (R-FCN requires all three)'),
    ('spatial_scale: 0.5 output_dim: 0 group_size: 2', (1, 4, 3, 3),
     'output_dim and group_size must be positive, got 0 and 2'),
    ('spatial_scale: inf output_dim: 1 group_size: 2', (1, 4, 3, 3),
     'spatial_scale must be finite, got inf'),
])
def test_bad_settings_are_one_line(settings, x_shape, message):
    text = ('name: "ps" type: "PSROIPooling" bottom: "x" bottom: "rois" top: "y" '
            'psroi_pooling_param { %s }' % settings)
    line = error_line(text, [np.zeros(x_shape), np.zeros((1, 5))])
    assert line == "layer 'ps' (type PSROIPooling): " + message
