"""NVCaffe's BatchNorm with scale_bias against float64 loops written from NVCaffe's
BatchNormLayer (its forward and backward passes, both engines' running statistics) on every
engine; finite differences in TRAIN and TEST; what it reads and ignores of its settings."""
import numpy as np
import pytest

from caffe_syncbn.layer import TEST, TRAIN
from caffe_syncbn.testing import build_layer
from helpers.net_helpers import build, input_layer

RS = np.random.RandomState(5)
SHAPE = (4, 3, 5, 6)
FRACTION = float(np.float32(0.9))            # a float field, as NVCaffe reads it


def nvcaffe_text(settings='scale_bias: true', name='bn'):
    return ('name: "%s" type: "BatchNorm" bottom: "x" top: "y" '
            'batch_norm_param { moving_average_fraction: 0.9 %s }' % (name, settings))


def nvcaffe_forward(x, blobs, phase, eps):
    """BatchNormLayer::Forward: TEST normalizes by blobs 0 and 1 as they are, TRAIN by the
    batch's mean and biased variance; eps at least 1e-5; then * scale + shift. Returns y,
    x_norm, the inverse std and the batch's (mean, biased var)."""
    n, c = x.shape[:2]
    x3 = x.reshape(n, c, -1).astype(np.float64)
    if phase == TEST:
        mean, var = blobs[0], blobs[1]
    else:
        mean = x3.mean(axis=(0, 2))
        var = ((x3 - mean[None, :, None]) ** 2).mean(axis=(0, 2))
    inv = (var + max(eps, float(np.float32(1e-5)))) ** -0.5
    x_norm = (x3 - mean[None, :, None]) * inv[None, :, None]
    y = x_norm * blobs[3][None, :, None] + blobs[4][None, :, None]
    return y.reshape(x.shape), x_norm, inv, (mean, var)


def nvcaffe_backward(dy, x_norm, inv, scale):
    """BatchNormLayer::Backward: d scale, d shift, then dE/dX through the batch statistics."""
    n, c = dy.shape[:2]
    dy3 = dy.reshape(n, c, -1)
    d_scale, d_shift = (dy3 * x_norm).sum(axis=(0, 2)), dy3.sum(axis=(0, 2))
    g = dy3 * scale[None, :, None]
    mean_g = g.mean(axis=(0, 2))[None, :, None]
    mean_gy = (g * x_norm).mean(axis=(0, 2))[None, :, None]
    dx = (g - mean_g - mean_gy * x_norm) * inv[None, :, None]
    return dx.reshape(dy.shape), d_scale, d_shift


def blobs_of(c=3, mean=0.0, var=0.0):
    return [np.full(c, mean), np.full(c, var), np.ones(1), RS.uniform(0.5, 2, c),
            RS.standard_normal(c)]


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_train_forward_and_backward_are_nvcaffes(engine, dtype):
    x = 3 + 2 * RS.standard_normal(SHAPE)
    params = blobs_of()
    dy = RS.standard_normal(SHAPE)
    text = nvcaffe_text('scale_bias: true eps: 1e-4')
    result = engine.run(text, [x], params=params, top_diffs=[dy], dtype=dtype)
    y, x_norm, inv, _ = nvcaffe_forward(x, params, TRAIN, float(np.float32(1e-4)))
    dx, d_scale, d_shift = nvcaffe_backward(dy, x_norm, inv, params[3])
    tolerance = 1e-10 if dtype == np.float64 else 2e-4
    np.testing.assert_allclose(result['top'][0], y, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(result['bottom_diff'][0], dx, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(result['param_diff'][3], d_scale, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(result['param_diff'][4], d_shift, rtol=tolerance, atol=tolerance)
    for j in range(3):
        assert not np.any(result['param_diff'][j])


def test_test_phase_reads_mean_and_var_as_they_are():
    """Blob 2 (NVCaffe's "variance correction") is read by nothing: 7 there changes nothing."""
    x = RS.standard_normal(SHAPE)
    params = [RS.standard_normal(3), RS.uniform(0.5, 2, 3), np.array([7.0]),
              RS.uniform(0.5, 2, 3), RS.standard_normal(3)]
    layer, bottom, top = build_layer(nvcaffe_text('scale_bias: true eps: 1e-8'), [x],
                                     phase=TEST)
    for blob, value in zip(layer.blobs, params):
        blob.data[...] = value
    layer.forward(bottom, top)
    y, _, inv, _ = nvcaffe_forward(x, params, TEST, 1e-8)        # eps: at least 1e-5
    np.testing.assert_allclose(top[0].data, y, rtol=1e-12)
    top[0].diff[...] = dy = RS.standard_normal(SHAPE)
    layer.backward(top, [True], bottom)
    expected = dy * (params[3] * inv)[None, :, None, None]       # TEST's true gradient
    np.testing.assert_allclose(bottom[0].diff, expected, rtol=1e-12)


def unbiased(var, count):
    return var * count / (count - 1)


@pytest.mark.parametrize('engine_setting, copies, unbiased_variance', [
    ('', 1, True), ('engine: CUDNN', 1, True), ('engine: CAFFE', 2, False)])
def test_running_statistics_are_each_engines(engine_setting, copies, unbiased_variance):
    """cuDNN's (NVCaffe's default): the first update copies the batch's mean and unbiased
    variance, later ones average with the fraction; NVCaffe's CAFFE engine copies on its
    first two forwards, of the biased variance. Blob 2 stays 1."""
    layer, bottom, top = build_layer(nvcaffe_text('scale_bias: true ' + engine_setting),
                                     [np.zeros(SHAPE)])
    count = SHAPE[0] * SHAPE[2] * SHAPE[3]
    running = None
    for step in range(4):
        x = step + (step + 1) * RS.standard_normal(SHAPE)
        bottom[0].data[...] = x
        layer.forward(bottom, top)
        mean, var = nvcaffe_forward(x, blobs_of(), TRAIN, 1e-5)[3]
        if unbiased_variance:
            var = unbiased(var, count)
        if step < copies:
            running = mean, var
        else:
            running = tuple(FRACTION * old + (1 - FRACTION) * new
                            for old, new in zip(running, (mean, var)))
        np.testing.assert_allclose(layer.blobs[0].data, running[0], rtol=1e-12)
        np.testing.assert_allclose(layer.blobs[1].data, running[1], rtol=1e-12)
        assert layer.blobs[2].data.tolist() == [1.0]


def test_loaded_statistics_are_averaged_from_the_first_step():
    """NVCaffe's cuDNN engine copies at the solver's iteration 0, which a new layer's zero
    statistics stand for here: statistics that are not all zero (loaded, or resumed) are
    averaged from the first step."""
    layer, bottom, top = build_layer(nvcaffe_text(), [3 + RS.standard_normal(SHAPE)])
    layer.blobs[0].data[...], layer.blobs[1].data[...] = 1.0, 2.0
    layer.forward(bottom, top)
    mean, var = nvcaffe_forward(bottom[0].data, blobs_of(), TRAIN, 1e-5)[3]
    var = unbiased(var, SHAPE[0] * SHAPE[2] * SHAPE[3])
    np.testing.assert_allclose(layer.blobs[0].data, FRACTION + (1 - FRACTION) * mean)
    np.testing.assert_allclose(layer.blobs[1].data, 2 * FRACTION + (1 - FRACTION) * var)


def test_the_phase_decides_whatever_use_global_stats_says():
    x = 3 + RS.standard_normal(SHAPE)
    layer, bottom, top = build_layer(nvcaffe_text('scale_bias: true use_global_stats: true'), [x])
    layer.forward(bottom, top)
    y = nvcaffe_forward(x, [layer.blobs[j].data for j in range(5)], TRAIN, 1e-5)[0]
    np.testing.assert_allclose(top[0].data, y, rtol=1e-12)


@pytest.mark.parametrize('settings', [
    'scale_bias: true', 'scale_filler { type: "constant" value: 2 }',
    'bias_filler { type: "constant" value: 3 }'])
def test_scale_bias_or_a_filler_makes_nvcaffes_five_blobs(settings):
    layer, _, _ = build_layer(nvcaffe_text(settings), [np.zeros(SHAPE)])
    assert type(layer).__name__ == 'NVCaffeBatchNorm'
    assert [b.shape for b in layer.blobs] == [(3,), (3,), (1,), (3,), (3,)]
    scale = 2.0 if 'scale_filler' in settings else 1.0
    shift = 3.0 if 'bias_filler' in settings else 0.0
    assert [b.data.tolist() for b in layer.blobs] == [[0.0] * 3, [0.0] * 3, [1.0], [scale] * 3,
                                                       [shift] * 3]
    plain, _, _ = build_layer(nvcaffe_text(''), [np.zeros(SHAPE)])
    assert type(plain).__name__ == 'BatchNorm' and len(plain.blobs) == 3


def test_scale_and_bias_learn_at_rate_1_whatever_the_prototxt_says():
    """NVCaffe's LayerSetUp sets lr_mult 0 on the statistics and lr_mult and decay_mult 1 on
    scale and bias over the prototxt's ParamSpecs."""
    net = build(input_layer('x', *SHAPE) + 'layer { %s %s }' % (
        nvcaffe_text(), ' '.join(['param { lr_mult: 0 decay_mult: 0 }'] * 5)))
    assert net.params_lr == [0, 0, 0, 1, 1]
    assert net.params_weight_decay == [0, 0, 0, 1, 1]


@pytest.mark.parametrize('phase', [TRAIN, TEST])
def test_gradient(host_engine, phase):
    x = 1 + RS.standard_normal((3, 2, 3, 2))
    text = nvcaffe_text('scale_bias: true scale_filler { type: "uniform" min: 0.5 max: 2 } '
                        'bias_filler { type: "gaussian" }')
    host_engine.check_gradient(text, [x], phase=phase)
