"""The layers of other forks (docs/fork-layers.md) against float64 loop references written
from each fork's source, finite differences, odd sizes and one-line errors on bad input."""
import numpy as np
import pytest
from google.protobuf import text_format

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.testing import build_layer, check_gradient

RS = np.random.RandomState(7)


def forward(text, bottoms):
    layer, bottom, top = build_layer(text, bottoms)
    layer.forward(bottom, top)
    return layer, bottom, top


def error_of(text, bottoms):
    with pytest.raises(CaffeError) as info:
        forward(text, bottoms)
    message = str(info.value)
    assert '\n' not in message
    return message


# ---- Upsample ------------------------------------------------------------------------------
def max_pool_with_mask(x, kernel=2, stride=2):
    layer, bottom, top = build_layer(
        'name: "p" type: "Pooling" bottom: "x" top: "y" top: "mask" '
        'pooling_param { pool: MAX kernel_size: %d stride: %d }' % (kernel, stride), [x])
    layer.forward(bottom, top)
    return top[0].data.copy(), top[1].data.copy()


def unpool_reference(x, mask, out_hw):
    """SegNet's loop: top[n, c] is zero but at each mask position, which gets its value."""
    n, c, h, w = x.shape
    top = np.zeros((n, c) + out_hw)
    for i in range(n):
        for j in range(c):
            for k in range(h * w):
                index = int(mask[i, j].reshape(-1)[k])
                top[i, j].reshape(-1)[index] = x[i, j].reshape(-1)[k]
    return top


UNPOOL = 'name: "u" type: "Upsample" bottom: "x" bottom: "mask" top: "y" upsample_param { %s }'


@pytest.mark.parametrize('settings, in_hw', [
    ('upsample_h: 7 upsample_w: 5', (7, 5)),           # odd sizes: ceil pooling's last row
    ('scale: 2 pad_out_h: true pad_out_w: true', (7, 5)),
    ('scale: 2', (6, 8)),
    ('scale_h: 2 scale_w: 2 pad_out_w: true', (6, 9)),
])
def test_upsample_unpools_by_the_pooling_mask(settings, in_hw):
    image = RS.standard_normal((2, 3) + in_hw)
    pooled, mask = max_pool_with_mask(image)
    _, _, top = forward(UNPOOL % settings, [pooled, mask])
    expected = unpool_reference(pooled, mask, in_hw)
    np.testing.assert_array_equal(top[0].data, expected)
    # the maxima are back where they were, zeros elsewhere
    assert np.all((top[0].data == 0) | (top[0].data == image))
    check_gradient(UNPOOL % settings, [pooled, mask], check_bottom=[0])


def test_upsample_backward_gives_each_input_the_diff_at_its_mask():
    pooled, mask = max_pool_with_mask(RS.standard_normal((1, 2, 5, 7)))
    layer, bottom, top = forward(UNPOOL % 'upsample_h: 5 upsample_w: 7', [pooled, mask])
    top[0].diff[...] = RS.standard_normal(top[0].shape)
    layer.backward(top, [True, False], bottom)
    flat = top[0].diff.reshape(2, -1)
    expected = np.stack([flat[c][mask[0, c].astype(int)] for c in range(2)])[None]
    np.testing.assert_array_equal(bottom[0].diff, expected)


def test_upsample_nearest_with_one_bottom():
    x = RS.standard_normal((2, 3, 3, 5))
    text = 'name: "u" type: "Upsample" bottom: "x" top: "y" upsample_param { scale: 3 }'
    _, _, top = forward(text, [x])
    expected = np.empty((2, 3, 9, 15))
    for h in range(9):
        for w in range(15):
            expected[:, :, h, w] = x[:, :, h // 3, w // 3]
    np.testing.assert_array_equal(top[0].data, expected)
    check_gradient(text, [x])


@pytest.mark.parametrize('settings, bottoms, message', [
    ('upsample_h: 5 upsample_w: 5', 'mask',
     'is outside the 5 x 5 top plane: the Pooling layer that made the mask'),
    ('upsample_h: 7', 'mask', 'upsample_h and upsample_w go together; got only upsample_h'),
    ('scale: 3 pad_out_h: true', 'mask',
     'pad_out_h needs the mask bottom and scale_h 2, got scale 3 and 2 bottom(s)'),
    ('scale: 1', 'mask', 'scale must be at least 2, got (1, 1)'),
    ('upsample_h: 7 upsample_w: 7', 'none',
     'upsample_h/upsample_w need the pooling mask as bottom 1'),
    ('scale: 2', 'small', 'the mask (bottom 1) must have the shape of bottom 0 (1, 2, 4, 4), '
                          'got (1, 2, 3, 4)'),
])
def test_upsample_bad_input_is_one_line(settings, bottoms, message):
    pooled, mask = max_pool_with_mask(RS.standard_normal((1, 2, 7, 7)))
    given = {'mask': [pooled, mask], 'none': [pooled], 'small': [pooled, mask[:, :, :3]]}
    text = UNPOOL % settings
    if bottoms == 'none':
        text = text.replace('bottom: "mask" ', '')
    line = error_of(text, given[bottoms])
    assert line.startswith("layer 'u' (type Upsample): ") and message in line, line


# ---- ShuffleChannel ------------------------------------------------------------------------
@pytest.mark.parametrize('group, shape', [(3, (2, 15, 3, 5)), (5, (1, 15, 1, 1)),
                                          (1, (2, 3, 2, 2)), (2, (3, 4, 7))])
def test_shuffle_channel(group, shape):
    x = RS.standard_normal(shape)
    text = ('name: "s" type: "ShuffleChannel" bottom: "x" top: "y" '
            'shuffle_channel_param { group: %d }' % group)
    _, _, top = forward(text, [x])
    per_group = shape[1] // group
    expected = np.empty_like(x)
    for i in range(group):              # the fork: input channel i * (C/g) + j -> j * g + i
        for j in range(per_group):
            expected[:, j * group + i] = x[:, i * per_group + j]
    np.testing.assert_array_equal(top[0].data, expected)
    check_gradient(text, [x])


def test_shuffle_channel_group_must_divide_the_channels():
    line = error_of('name: "s" type: "ShuffleChannel" bottom: "x" top: "y" '
                    'shuffle_channel_param { group: 4 }', [np.zeros((1, 15, 2, 2))])
    assert line == ("layer 's' (type ShuffleChannel): group 4 must divide the channels (axis 1) "
                    "of the bottom, shape (1, 15, 2, 2)")


# ---- Axpy ------------------------------------------------------------------------------------
@pytest.mark.parametrize('scale_shape', [(2, 5, 1, 1), (2, 5)])
def test_axpy(scale_shape):
    a, x, y = RS.standard_normal(scale_shape), RS.standard_normal((2, 5, 3, 7)), \
        RS.standard_normal((2, 5, 3, 7))
    text = 'name: "a" type: "Axpy" bottom: "a" bottom: "x" bottom: "y" top: "z"'
    _, _, top = forward(text, [a, x, y])
    expected = np.empty_like(x)
    for n in range(2):
        for c in range(5):
            expected[n, c] = a.reshape(2, 5)[n, c] * x[n, c] + y[n, c]
    np.testing.assert_allclose(top[0].data, expected, rtol=1e-15)
    check_gradient(text, [a, x, y])


def test_axpy_scale_shape_is_checked():
    line = error_of('name: "a" type: "Axpy" bottom: "a" bottom: "x" bottom: "y" top: "z"',
                    [np.zeros((2, 5, 3, 1)), np.zeros((2, 5, 3, 7)), np.zeros((2, 5, 3, 7))])
    assert line == ("layer 'a' (type Axpy): bottom 0 (the scale) must be (N, C) or (N, C, 1, 1) "
                    "of bottom 1 shape (2, 5, 3, 7), got (2, 5, 3, 1)")


# ---- depthwise convolutions ----------------------------------------------------------------
def depthwise_reference(x, weight, bias, pad, stride, kernel):
    n, c, h, w = x.shape
    padded = np.zeros((n, c, h + 2 * pad, w + 2 * pad))
    padded[:, :, pad:pad + h, pad:pad + w] = x
    oh, ow = (h + 2 * pad - kernel) // stride + 1, (w + 2 * pad - kernel) // stride + 1
    out = np.zeros((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            window = padded[:, :, i * stride:i * stride + kernel, j * stride:j * stride + kernel]
            out[:, :, i, j] = (window * weight[None, :, 0]).sum(axis=(2, 3)) + bias
    return out


DEPTHWISE = ('name: "dw" type: "%s" bottom: "x" top: "y" convolution_param { %s kernel_size: 3 '
             'pad: 1 stride: 2 weight_filler { type: "gaussian" } bias_filler { type: "gaussian" '
             '} }')


@pytest.mark.parametrize('kind, counts', [('ConvolutionDepthwise', 'num_output: 16'),
                                          ('ConvolutionDepthwise', ''),
                                          ('DepthwiseConvolution', 'num_output: 5 group: 5')])
def test_depthwise_convolution_is_per_channel(kind, counts):
    x = RS.standard_normal((2, 5, 7, 6))
    text = DEPTHWISE % (kind, counts)
    layer, _, top = forward(text, [x])
    weight, bias = layer.blobs[0].data, layer.blobs[1].data
    assert weight.shape == (5, 1, 3, 3) and bias.shape == (5,)
    np.testing.assert_allclose(top[0].data, depthwise_reference(x, weight, bias, 1, 2, 3),
                               rtol=1e-12, atol=1e-12)
    check_gradient(text, [x])


def test_depthwise_convolution_keeps_the_prototxt_settings():
    layer, _, _ = forward(DEPTHWISE % ('ConvolutionDepthwise', 'num_output: 16'),
                          [np.zeros((1, 5, 4, 4))])
    assert layer.param.convolution_param.num_output == 16
    assert not layer.param.convolution_param.HasField('group')


def test_depthwise_convolution_needs_group_and_num_output_at_the_channels():
    line = error_of(DEPTHWISE % ('DepthwiseConvolution', 'num_output: 5'),
                    [np.zeros((1, 5, 4, 4))])
    assert line == ("layer 'dw' (type DepthwiseConvolution): computes one filter per channel: "
                    "needs group = num_output = channels (5), got group 1 and num_output 5")


@pytest.mark.parametrize('kind', ['ConvolutionDepthwise', 'DepthwiseConvolution'])
def test_depthwise_caffemodel_of_the_fork_loads(tmp_path, kind):
    """A caffemodel as the forks write it: blobs (C, 1, k, k) and (C,)."""
    deploy = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 '
              'dim: 4 dim: 5 dim: 5 } } }\nlayer { name: "dw" type: "%s" bottom: "data" '
              'top: "y" convolution_param { num_output: 4 group: 4 kernel_size: 3 pad: 1 } }\n'
              % kind)
    (tmp_path / 'deploy.prototxt').write_text(deploy)
    weight, bias = RS.standard_normal((4, 1, 3, 3)), RS.standard_normal(4)
    model = caffe_pb2.NetParameter()
    layer = model.layer.add(name='dw', type=kind)
    for array in (weight, bias):
        blob = layer.blobs.add()
        blob.shape.dim.extend(array.shape)
        blob.data.extend(array.reshape(-1).tolist())
    (tmp_path / 'fork.caffemodel').write_bytes(model.SerializeToString())
    net = caffe.Net(str(tmp_path / 'deploy.prototxt'), str(tmp_path / 'fork.caffemodel'),
                    caffe.TEST)
    x = RS.standard_normal((1, 4, 5, 5))
    y = net.forward(data=x)['y']
    expected = depthwise_reference(x, weight.astype(np.float32), bias.astype(np.float32), 1, 1, 3)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


# ---- ROIPooling ------------------------------------------------------------------------------
def c_round(v):
    return np.floor(v + 0.5) if v >= 0 else -np.floor(-v + 0.5)


def roi_pool_reference(x, rois, pooled_h, pooled_w, scale):
    """py-faster-rcnn's Forward_cpu, loop for loop, with its argmax (h * W + w, -1 if empty)."""
    n, c, height, width = x.shape
    top = np.zeros((len(rois), c, pooled_h, pooled_w))
    argmax = -np.ones(top.shape, int)
    for r, roi in enumerate(rois):
        b = int(roi[0])
        x1, y1, x2, y2 = (int(c_round(v * scale)) for v in roi[1:])
        roi_h, roi_w = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        for ph in range(pooled_h):
            for pw in range(pooled_w):
                hs = min(max(int(np.floor(ph * roi_h / pooled_h)) + y1, 0), height)
                he = min(max(int(np.ceil((ph + 1) * roi_h / pooled_h)) + y1, 0), height)
                ws = min(max(int(np.floor(pw * roi_w / pooled_w)) + x1, 0), width)
                we = min(max(int(np.ceil((pw + 1) * roi_w / pooled_w)) + x1, 0), width)
                for ch in range(c):
                    best, where = -np.inf, -1
                    for h in range(hs, he):
                        for w in range(ws, we):
                            if x[b, ch, h, w] > best:
                                best, where = x[b, ch, h, w], h * width + w
                    top[r, ch, ph, pw] = best if where >= 0 else 0
                    argmax[r, ch, ph, pw] = where
    return top, argmax


ROI = ('name: "roi" type: "ROIPooling" bottom: "x" bottom: "rois" top: "y" '
       'roi_pooling_param { pooled_h: %d pooled_w: %d spatial_scale: %s }')
ROIS = np.array([[0, 0, 0, 12, 8],
                 [1, 5, 3, 5, 3],           # one cell; 2.5 rounds up (numpy's round: 2)
                 [1, -7, -3, 30, 21],       # past every edge
                 [0, 40, 40, 50, 60],       # wholly outside: empty bins give 0
                 [1, 3, 1, 9, 13],
                 [0, 1.2, 2.6, 7.4, 11.5]])


@pytest.mark.parametrize('pooled_h, pooled_w, scale', [(2, 3, '0.5'), (3, 3, '0.0625'),
                                                       (4, 1, '1')])
def test_roi_pooling_matches_the_fork(pooled_h, pooled_w, scale):
    x = RS.standard_normal((2, 3, 7, 9))
    x[0, 0, :4, :4] = 1.0                   # ties: the first in row-major order wins
    text = ROI % (pooled_h, pooled_w, scale)
    layer, bottom, top = forward(text, [x, ROIS])
    expected, argmax = roi_pool_reference(x, ROIS, pooled_h, pooled_w, float(scale))
    np.testing.assert_array_equal(top[0].data, expected)
    np.testing.assert_array_equal(layer.argmax, argmax)
    top[0].diff[...] = RS.standard_normal(top[0].shape)
    layer.backward(top, [True, False], bottom)
    dx = np.zeros_like(x)
    for r, roi in enumerate(ROIS):
        for index in np.ndindex(argmax.shape[1:]):
            if argmax[(r,) + index] >= 0:
                plane = dx[int(roi[0]), index[0]].reshape(-1)
                plane[argmax[(r,) + index]] += top[0].diff[(r,) + index]
    np.testing.assert_allclose(bottom[0].diff, dx, rtol=1e-14)
    check_gradient(text, [RS.standard_normal(x.shape), ROIS], check_bottom=[0])


@pytest.mark.parametrize('rois, message', [
    (np.array([[2, 0, 0, 3, 3]]), 'ROI 0 has batch index 2; bottom 0 holds 2 image(s)'),
    (np.zeros((3, 4)), 'bottom 1 must hold 5 values per ROI (batch index, x1, y1, x2, y2), '
                       'got shape (3, 4)'),
    (np.array([[0, 0, 0, 2, 2], [0, 1, np.nan, 2, 2]]), 'ROI 1 is not finite: '
                                                       '[0.0, 1.0, nan, 2.0, 2.0]'),
])
def test_roi_pooling_bad_rois_are_one_line(rois, message):
    line = error_of(ROI % (2, 2, '1'), [np.zeros((2, 3, 4, 4)), rois])
    assert line == "layer 'roi' (type ROIPooling): " + message
    line = error_of(ROI % (2, 2, 'inf'), [np.zeros((2, 3, 4, 4)), rois])
    assert line == "layer 'roi' (type ROIPooling): spatial_scale must be finite, got inf"


# ---- SmoothL1Loss --------------------------------------------------------------------------
def smooth_l1_reference(b0, b1, sigma=1.0, inside=None, outside=None):
    d = (b0 - b1) * (1 if inside is None else inside)
    s2 = sigma * sigma
    f = np.where(np.abs(d) < 1 / s2, 0.5 * s2 * d * d, np.abs(d) - 0.5 / s2)
    return float((f * (1 if outside is None else outside)).sum() / b0.shape[0])


def smooth_l1(bottoms, sigma=None):
    names = ' '.join('bottom: "b%d"' % i for i in range(len(bottoms)))
    param = ' smooth_l1_loss_param { sigma: %g }' % sigma if sigma is not None else ''
    return 'name: "loss" type: "SmoothL1Loss" %s top: "loss"%s' % (names, param)


@pytest.mark.parametrize('count, sigma', [(2, None), (3, None), (4, None), (4, 3.0),
                                          (2, 0.5)])
def test_smooth_l1_loss(count, sigma):
    shape = (3, 4, 2, 5)
    bottoms = [RS.standard_normal(shape) * 2, RS.standard_normal(shape)]
    bottoms += [RS.uniform(0, 2, shape) for _ in range(count - 2)]
    _, _, top = forward(smooth_l1(bottoms, sigma), bottoms)
    expected = smooth_l1_reference(*bottoms[:2], 1.0 if sigma is None else sigma, *bottoms[2:])
    np.testing.assert_allclose(float(top[0].data), expected, rtol=1e-13)
    check_gradient(smooth_l1(bottoms, sigma), bottoms, check_bottom=[0, 1])


def test_smooth_l1_loss_gradient_is_the_ssd_forks_for_its_zero_one_weights():
    """The SSD fork's backward is sign or d times 1/N, without its weights."""
    shape = (4, 8)
    b0, b1 = RS.standard_normal(shape) * 2, RS.standard_normal(shape)
    weights = (RS.uniform(size=shape) < 0.5).astype(float)
    layer, bottom, top = forward(smooth_l1([b0, b1, weights]), [b0, b1, weights])
    top[0].diff[...] = 1
    layer.backward(top, [True, True, False], bottom)
    d = (b0 - b1) * weights
    fork = np.where(np.abs(d) < 1, d, np.sign(d)) / shape[0]
    np.testing.assert_allclose(bottom[0].diff, fork, rtol=1e-15)
    np.testing.assert_allclose(bottom[1].diff, -fork, rtol=1e-15)


def test_smooth_l1_loss_bad_input_is_one_line():
    line = error_of(smooth_l1([0, 0]), [np.zeros((2, 3)), np.zeros((2, 4))])
    assert line == ("layer 'loss' (type SmoothL1Loss): bottom 1 must have the shape of "
                    "bottom 0 (2, 3), got (2, 4)")
    line = error_of(smooth_l1([0] * 5), [np.zeros((2, 3))] * 5)
    assert line == "layer 'loss' (type SmoothL1Loss): expects 2..4 bottom blob(s), got 5"


SEGNET_STYLE = '''name: "mini_segnet"
force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 9 dim: 11 } shape { dim: 2 dim: 1 dim: 9 dim: 11 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" top: "pool1_mask"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "dw" type: "ConvolutionDepthwise" bottom: "pool1" top: "dw"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "shuffle" type: "ShuffleChannel" bottom: "dw" top: "shuffle"
        shuffle_channel_param { group: 2 } }
layer { name: "upsample1" type: "Upsample" bottom: "shuffle" bottom: "pool1_mask" top: "up1"
        upsample_param { scale: 2 upsample_h: 9 upsample_w: 11 } }
layer { name: "score" type: "Convolution" bottom: "up1" top: "score"
        convolution_param { num_output: 1 kernel_size: 1 weight_filler { type: "msra" } } }
layer { name: "loss" type: "SmoothL1Loss" bottom: "score" bottom: "label" top: "loss" }
'''


def test_a_segnet_style_net_runs_forward_and_backward():
    net = caffe.Net(text_format.Parse(SEGNET_STYLE, caffe_pb2.NetParameter()), caffe.TRAIN)
    data, label = RS.standard_normal((2, 3, 9, 11)), RS.standard_normal((2, 1, 9, 11))
    loss = float(net.forward(data=data, label=label)['loss'])
    assert np.isfinite(loss) and loss > 0
    net.backward()
    assert np.abs(net.blobs['data'].diff).sum() > 0
    assert np.abs(net.params['dw'][0].diff).sum() > 0
