"""Vision layers: Convolution, Deconvolution, Im2col, Pooling, SPP, LRN, InnerProduct,
Embed and the PSPNet Interp layer.  Caffe's golden outputs, finite-difference gradients,
and the corner cases of each layer."""
import json

import numpy as np
import pytest
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layer import TEST, TRAIN
from caffe_syncbn.layers.conv import array as conv_module
from caffe_syncbn.layers.conv.array import col2im, im2col
from caffe_syncbn.testing import build_layer, check_gradient
from conftest import GOLDEN, require
from golden_layer_case import RTOL, ATOL, run_single_layer_case, single_layer_cases

MY_TYPES = ['Convolution', 'Deconvolution', 'Im2col', 'Pooling', 'SPP', 'LRN', 'InnerProduct',
            'Embed', 'Interp']


def _psp_interp_cases():
    index = GOLDEN / 'psp_index.json'
    if not index.exists():
        return ['<no golden data>']
    return [c['name'] for c in json.loads(index.read_text())['cases']
            if c['kind'] == 'layer' and set(c['layer_types']) == {'Input', 'Interp'}]


# ---------------------------------------------------------------- golden cases

@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('case', single_layer_cases(MY_TYPES) + _psp_interp_cases())
def test_golden_single_layer(case, dtype, monkeypatch):
    run_single_layer_case(case, monkeypatch, dtype=dtype)


def test_golden_embed():
    """Embed feeds an EuclideanLoss in its case; its top diff is the recorded diff/emb."""
    require(GOLDEN / 'embed.npz')
    net = text_format.Parse((GOLDEN / 'embed.prototxt').read_text(), caffe_pb2.NetParameter())
    (param,) = [lp for lp in net.layer if lp.type == 'Embed']
    ref = np.load(GOLDEN / 'embed.npz')
    layer, bottom, top = build_layer(param, [ref['data/idx']], dtype=np.float32)
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = ref['param_after/embed/%d' % i]
    layer.forward(bottom, top)
    np.testing.assert_allclose(top[0].data, ref['data/emb'], rtol=RTOL, atol=ATOL)
    assert layer.allow_force_backward(0) is False
    top[0].diff[...] = ref['diff/emb']
    layer.backward(top, [False], bottom)
    for i, blob in enumerate(layer.blobs):
        np.testing.assert_allclose(blob.diff, ref['param_diff/embed/%d' % i],
                                   rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------- helpers

def _distinct(shape, seed=0, scale=0.1):
    """Inputs with no ties, so MAX pooling stays away from its kinks."""
    rs = np.random.RandomState(seed)
    return (rs.permutation(int(np.prod(shape))).reshape(shape) - np.prod(shape) / 2.0) * scale


def _randn(*shape, seed=0):
    return np.random.RandomState(seed).standard_normal(shape)


def _conv(body, kind='Convolution', bottoms=('x',), tops=('y',)):
    links = ''.join('bottom: "%s" ' % b for b in bottoms) + ''.join('top: "%s" ' % t for t in tops)
    return ('name: "c" type: "%s" %s convolution_param { %s weight_filler { type: "gaussian" '
            'std: 0.5 } bias_filler { type: "uniform" min: -0.5 max: 0.5 } }'
            % (kind, links, body))


def _forward(text, bottoms, phase=TRAIN, dtype=np.float64):
    layer, bottom, top = build_layer(text, bottoms, phase=phase, dtype=dtype)
    layer.forward(bottom, top)
    return layer, bottom, top


# ---------------------------------------------------------------- convolution

@pytest.mark.parametrize('body, shape', [
    ('num_output: 3 kernel_size: 3 pad: 1', (2, 2, 5, 4)),
    ('num_output: 4 kernel_size: 3 stride: 2 dilation: 2 pad: 2 group: 2', (2, 4, 7, 6)),
    ('num_output: 2 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 '
     'bias_term: false', (1, 2, 5, 5)),
    ('num_output: 3 kernel_size: 1', (2, 3, 3, 4)),
    ('num_output: 2 kernel_size: 1 stride: 2', (2, 3, 5, 4)),
    ('num_output: 2 kernel_size: 3 kernel_size: 2 kernel_size: 2 pad: 1 stride: 1 stride: 2 '
     'stride: 1', (1, 2, 4, 4, 3)),
    ('num_output: 2 kernel_size: 2 axis: 2', (2, 1, 2, 4, 3)),
])
def test_convolution_gradient(body, shape):
    check_gradient(_conv(body), [_randn(*shape)])


def test_convolution_two_bottoms_share_weights():
    text = _conv('num_output: 2 kernel_size: 2', bottoms=('a', 'b'), tops=('p', 'q'))
    check_gradient(text, [_randn(2, 2, 3, 3), _randn(2, 2, 3, 3, seed=1)])
    layer, bottom, top = _forward(text, [_randn(2, 2, 3, 3), _randn(2, 2, 3, 3)])
    np.testing.assert_array_equal(top[0].data, top[1].data)


@pytest.mark.parametrize('body, shape', [
    ('num_output: 3 kernel_size: 3 stride: 2 pad: 1', (2, 2, 3, 4)),
    ('num_output: 4 kernel_size: 4 stride: 2 pad: 1 group: 2 dilation: 2', (1, 2, 3, 3)),
    ('num_output: 2 kernel_size: 1 bias_term: false', (2, 3, 2, 3)),
])
def test_deconvolution_gradient(body, shape):
    check_gradient(_conv(body, 'Deconvolution'), [_randn(*shape)])


def test_deconvolution_output_size():
    layer, _, top = _forward(_conv('num_output: 2 kernel_size: 4 stride: 2 pad: 1 dilation: 1',
                                   'Deconvolution'), [_randn(1, 3, 5, 6)])
    assert top[0].shape == (1, 2, 10, 12)
    assert layer.blobs[0].shape == (3, 2, 4, 4)


def test_deconvolution_is_the_adjoint_of_convolution():
    x, y_diff = _randn(2, 4, 5, 5), _randn(2, 3, 3, 3, seed=1)
    body = 'num_output: %d kernel_size: 3 stride: 2 pad: 1 group: 1 bias_term: false'
    conv, cb, ct = _forward(_conv(body % 3), [x])
    deconv, db, dt = _forward(_conv(body % 4, 'Deconvolution'), [y_diff])
    deconv.blobs[0].data[...] = conv.blobs[0].data
    deconv.forward(db, dt)
    # <conv(x), y> == <x, deconv(y)>
    np.testing.assert_allclose(np.sum(ct[0].data * y_diff), np.sum(x * dt[0].data))


@pytest.mark.parametrize('wide', [0, 10 ** 9])
def test_batched_and_folded_gemms_agree(wide, monkeypatch):
    """The GEMMs of the array path (GPUs): per image (wide images) or over the folded batch."""
    monkeypatch.setattr(conv_module, '_WIDE_IMAGE', wide)
    w, x, a = _randn(2, 3, 4), _randn(3, 2, 4, 5, seed=1), _randn(3, 2, 3, 5, seed=2)
    np.testing.assert_allclose(conv_module.grouped_matmul(w, x),
                               np.einsum('gmk,ngkp->ngmp', w, x), rtol=1e-12)
    np.testing.assert_allclose(conv_module.grouped_outer(a, x),
                               np.einsum('ngmp,ngkp->gmk', a, x), rtol=1e-12)


def test_convolution_skips_param_grads_with_lr_mult_zero():
    layer, bottom, top = _forward(_conv('num_output: 2 kernel_size: 3'), [_randn(1, 2, 4, 4)])
    layer.param_propagate_down = [False, False]
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    assert not layer.blobs[0].diff.any() and not layer.blobs[1].diff.any()
    assert bottom[0].diff.any()


@pytest.mark.parametrize('body, message', [
    ('num_output: 3 kernel_size: 3 group: 2', 'group'),
    ('num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3', 'not both'),
    ('num_output: 2 kernel_h: 3', 'both kernel_h and kernel_w'),
    ('num_output: 2 kernel_size: 3 kernel_size: 3 kernel_size: 3', '1 or 2'),
    ('num_output: 2 kernel_size: 7', 'empty'),
    ('num_output: 2', 'kernel_size'),
])
def test_convolution_errors(body, message):
    with pytest.raises(CaffeError, match=message):
        build_layer(_conv(body), [_randn(1, 4, 5, 5)])


# ---------------------------------------------------------------- im2col

def test_im2col_layer_gradient_and_channel_order():
    text = ('name: "i" type: "Im2col" bottom: "x" top: "y" '
            'convolution_param { kernel_size: 2 stride: 1 pad: 1 dilation: 2 }')
    check_gradient(text, [_randn(2, 2, 4, 3)])
    x = _randn(1, 2, 3, 3)
    _, _, top = _forward(text.replace('dilation: 2', ''), [x])
    # channel (c, kh, kw) at output (i, j) reads x[c, i + kh - 1, j + kw - 1]
    assert top[0].shape == (1, 8, 4, 4)
    assert top[0].data[0, 1 * 4 + 1 * 2 + 0, 2, 3] == x[0, 1, 2, 2]
    assert top[0].data[0, 0, 0, 0] == 0


def test_col2im_is_the_adjoint_of_im2col():
    geometry = dict(kernel=(3, 2, 2), pad=(1, 0, 1), stride=(2, 1, 2), dilation=(1, 2, 1))
    x = _randn(2, 3, 5, 6, 4)
    col = im2col(x, **geometry)
    c = _randn(*col.shape, seed=3)
    np.testing.assert_allclose(np.sum(col * c), np.sum(x * col2im(c, x.shape[2:], **geometry)))


# ---------------------------------------------------------------- pooling

def _pool(body, tops=('y',)):
    return ('name: "p" type: "Pooling" bottom: "x" %s pooling_param { %s }'
            % (''.join('top: "%s" ' % t for t in tops), body))


@pytest.mark.parametrize('body, shape', [
    ('pool: MAX kernel_size: 3 stride: 2', (2, 2, 6, 7)),
    ('pool: MAX kernel_size: 2 stride: 2 pad: 1', (1, 2, 5, 5)),
    ('pool: MAX kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 2 pad_h: 1', (1, 2, 5, 4)),
    ('pool: MAX kernel_size: 2 stride: 3', (1, 2, 7, 7)),
    ('pool: MAX global_pooling: true', (2, 3, 3, 4)),
    ('pool: AVE kernel_size: 3 stride: 2 pad: 1', (2, 2, 6, 6)),
    ('pool: AVE kernel_size: 3 stride: 2', (1, 2, 6, 8)),
    ('pool: AVE kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1', (1, 2, 5, 4)),
    ('pool: AVE global_pooling: true', (2, 3, 3, 4)),
    ('pool: AVE kernel_size: 3 stride: 2 round_mode: FLOOR', (1, 2, 6, 8)),
])
def test_pooling_gradient(body, shape):
    check_gradient(_pool(body), [_distinct(shape)])


def test_max_pooling_ties_and_mask():
    """On ties the first maximum in row-major order wins, as in Caffe."""
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 1, 0] = x[0, 0, 0, 1] = 5    # both in the first 2x2 window: (0, 1) comes first
    layer, bottom, top = _forward(_pool('pool: MAX kernel_size: 2 stride: 2', ('y', 'mask')), [x])
    assert top[1].data[0, 0, 0, 0] == 1           # h * W + w of (0, 1)
    assert top[1].data[0, 0, 1, 1] == 2 * 4 + 2   # all zeros: the window's first cell
    top[0].diff[...] = 1
    layer.backward(top, [True, False], bottom)
    assert bottom[0].diff[0, 0, 0, 1] == 1 and bottom[0].diff[0, 0, 1, 0] == 0


def test_overlapping_max_pooling_adds_gradients_of_shared_maxima():
    x = np.zeros((1, 1, 3, 3))
    x[0, 0, 1, 1] = 1
    layer, bottom, top = _forward(_pool('pool: MAX kernel_size: 2 stride: 1'), [x])
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    assert bottom[0].diff[0, 0, 1, 1] == 4


def test_stochastic_pooling():
    x = np.abs(_distinct((2, 2, 5, 5))) + 0.1
    body = 'pool: STOCHASTIC kernel_size: 3 stride: 2'
    _, _, top = _forward(_pool(body), [x], phase=TEST)
    window = x[0, 1, 2:5, 0:3]
    np.testing.assert_allclose(top[0].data[0, 1, 1, 0], np.sum(window ** 2) / np.sum(window))
    layer, bottom, top = _forward(_pool(body), [x], phase=TRAIN)
    assert top[0].data[0, 1, 1, 0] in window        # a sampled cell of its window
    top[0].diff[...] = 1
    layer.backward(top, [True], bottom)
    assert bottom[0].diff.sum() == top[0].count
    assert set(np.unique(bottom[0].diff)) <= {0, 1, 2, 3, 4}
    test_layer, bottom, top = _forward(_pool(body), [x], phase=TEST)
    with pytest.raises(CaffeError, match='TEST'):
        test_layer.backward(top, [True], bottom)


@pytest.mark.parametrize('body, message', [
    ('pool: MAX kernel_size: 2 pad: 2', 'smaller than the kernel'),
    ('pool: AVE global_pooling: true kernel_size: 2', 'global_pooling'),
    ('pool: STOCHASTIC kernel_size: 3 pad: 1', 'MAX and AVE'),
    ('pool: MAX', 'kernel_size'),
])
def test_pooling_errors(body, message):
    with pytest.raises(CaffeError, match=message):
        build_layer(_pool(body), [_randn(1, 1, 5, 5)])


def test_pooling_mask_top_only_for_max():
    with pytest.raises(CaffeError, match='top'):
        build_layer(_pool('pool: AVE kernel_size: 2', ('y', 'mask')), [_randn(1, 1, 4, 4)])


@pytest.mark.parametrize('body, shape, out', [
    ('pyramid_height: 3 pool: MAX', (2, 2, 7, 7), (2, 42)),
    ('pyramid_height: 2 pool: AVE', (1, 2, 6, 9), (1, 10)),
    ('pyramid_height: 1 pool: MAX', (1, 2, 3, 4), (1, 2, 1, 1)),
])
def test_spp(body, shape, out):
    text = 'name: "s" type: "SPP" bottom: "x" top: "y" spp_param { %s }' % body
    _, _, top = _forward(text, [_distinct(shape)])
    assert top[0].shape == out
    check_gradient(text, [_distinct(shape)])


# ---------------------------------------------------------------- LRN

@pytest.mark.parametrize('body', [
    'local_size: 5 alpha: 0.5 beta: 0.75 k: 1.5',
    'local_size: 3 alpha: 0.3 beta: 0.6 norm_region: WITHIN_CHANNEL',
])
def test_lrn_gradient(body):
    check_gradient('name: "l" type: "LRN" bottom: "x" top: "y" lrn_param { %s }' % body,
                   [_randn(2, 7, 3, 4)])


def test_lrn_across_channels_formula():
    x = _randn(1, 4, 2, 2)
    _, _, top = _forward('name: "l" type: "LRN" bottom: "x" top: "y" '
                         'lrn_param { local_size: 3 alpha: 0.6 beta: 0.75 k: 2 }', [x])
    scale = 2 + 0.2 * (x[0, 0] ** 2 + x[0, 1] ** 2)     # channel 0: window {0, 1} (zero pad)
    np.testing.assert_allclose(top[0].data[0, 0], x[0, 0] * scale ** -0.75)


def test_lrn_needs_odd_size():
    with pytest.raises(CaffeError, match='odd'):
        build_layer('name: "l" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 4 }',
                    [_randn(1, 4, 2, 2)])


# ---------------------------------------------------------------- InnerProduct, Embed

def _ip(body):
    return ('name: "f" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { %s '
            'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" } }'
            % body)


@pytest.mark.parametrize('body, shape, out', [
    ('num_output: 3', (2, 2, 3), (2, 3)),
    ('num_output: 4 axis: 2', (2, 3, 5), (2, 3, 4)),
    ('num_output: 3 transpose: true', (2, 4), (2, 3)),
    ('num_output: 2 bias_term: false axis: -1', (3, 2, 3), (3, 2, 2)),
])
def test_inner_product(body, shape, out):
    layer, _, top = _forward(_ip(body), [_randn(*shape)])
    assert top[0].shape == out
    check_gradient(_ip(body), [_randn(*shape)])


def test_inner_product_rejects_a_changed_input_size():
    layer, bottom, top = build_layer(_ip('num_output: 3'), [_randn(2, 4)])
    bottom[0].reshape(2, 5)
    with pytest.raises(CaffeError, match='expected 4 inputs'):
        layer.reshape(bottom, top)


_EMBED = ('name: "e" type: "Embed" bottom: "i" top: "y" embed_param { num_output: 3 '
          'input_dim: 5 weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }')


def test_embed_forward_and_param_gradient():
    idx = np.array([[1, 4], [1, 0]], float)
    layer, _, top = _forward(_EMBED, [idx])
    assert top[0].shape == (2, 2, 3)
    np.testing.assert_allclose(top[0].data[1, 0], layer.blobs[0].data[1] + layer.blobs[1].data)
    check_gradient(_EMBED, [idx], check_bottom=[])


@pytest.mark.parametrize('idx, message', [([0.5], 'integers'), ([5], r'\[0, 5\)')])
def test_embed_rejects_bad_indices(idx, message):
    layer, bottom, top = build_layer(_EMBED, [np.array(idx)])
    with pytest.raises(CaffeError, match=message):
        layer.forward(bottom, top)


def test_embed_has_no_bottom_gradient():
    layer, bottom, top = _forward(_EMBED, [np.array([1.0])])
    assert not layer.allow_force_backward(0)
    with pytest.raises(CaffeError, match='backpropagate'):
        layer.backward(top, [True], bottom)


# ---------------------------------------------------------------- Interp

def _interp(body):
    return 'name: "r" type: "Interp" bottom: "x" top: "y" interp_param { %s }' % body


@pytest.mark.parametrize('body, shape, out', [
    ('zoom_factor: 3', (1, 2, 3, 4), (1, 2, 7, 10)),
    ('shrink_factor: 2', (1, 1, 5, 6), (1, 1, 3, 3)),
    ('shrink_factor: 2 zoom_factor: 3', (1, 1, 5, 6), (1, 1, 7, 7)),
    ('height: 5 width: 2 pad_beg: -1 pad_end: -1', (2, 1, 5, 6), (2, 1, 5, 2)),
    ('height: 1 width: 3', (1, 1, 3, 3), (1, 1, 1, 3)),
    ('height: 3 width: 4 pad_beg: -1', (1, 1, 4, 5), (1, 1, 3, 4)),
])
def test_interp_shapes_and_gradient(body, shape, out):
    _, _, top = _forward(_interp(body), [_randn(*shape)])
    assert top[0].shape == out
    check_gradient(_interp(body), [_randn(*shape)])


def test_interp_aligns_corners():
    x = _randn(1, 1, 3, 4)
    _, _, top = _forward(_interp('zoom_factor: 4'), [x])
    y = top[0].data[0, 0]
    np.testing.assert_allclose(y[::4, ::4], x[0, 0])
    np.testing.assert_allclose(y[2, 2], x[0, 0, :2, :2].mean())


@pytest.mark.parametrize('body, message', [
    ('pad_beg: 1 zoom_factor: 2', '<= 0'),
    ('height: 4', 'height and width'),
    ('pad_beg: -2 pad_end: -2 zoom_factor: 2', 'nothing'),
])
def test_interp_errors(body, message):
    with pytest.raises(CaffeError, match=message):
        build_layer(_interp(body), [_randn(1, 1, 4, 4)])
