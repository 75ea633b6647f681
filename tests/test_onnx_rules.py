"""The ONNX rules on small nets, against our own forward, for what the golden cases do not
cover: parameter variants, ties, in-place chains, every pooling geometry, dynamic batch."""
import itertools
import re

import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn.errors import CaffeError
from helpers.onnx_helpers import (assert_close, highest_common_opset, input_layer, parse, run,
                                  weights_of)

pytest.importorskip('onnx', reason="ONNX export needs onnx: pip install '.[onnx]'")
pytest.importorskip('onnxruntime', reason='the ONNX tests run models with onnxruntime: '
                                          'pip install onnxruntime')
from caffe_syncbn.export import to_onnx  # noqa: E402  (after the skips)

OPSETS = sorted({17, highest_common_opset()})


def build(text, seed=0, inputs=None):
    """Net (TEST) of ``text`` with random weights, and its inputs: standard normals, or
    ``inputs(rng, shape)``."""
    param = parse(text)
    net = caffe.Net(param, caffe.TEST)
    rng = np.random.default_rng(seed)
    for name, blobs in net.params.items():
        for blob in blobs:
            blob.data[...] = rng.standard_normal(blob.shape)
    draw = inputs or (lambda rng, shape: rng.standard_normal(shape))
    feeds = {name: np.asarray(draw(rng, net.blobs[name].shape), np.float32)
             for name in net.inputs}
    return param, net, feeds


def check(text, inputs=None, opsets=OPSETS, **export_args):
    """Export ``text`` at each opset; onnxruntime's outputs equal our forward's."""
    param, net, feeds = build(text, inputs=inputs)
    expected = {k: np.array(v) for k, v in net.forward(**feeds).items()}
    for opset in opsets:
        model = to_onnx(param, weights_of(net), opset=opset, **export_args)
        outputs = run(model, feeds)
        assert sorted(outputs) == sorted(expected)
        for name, value in outputs.items():
            assert_close(value, expected[name], '%s at opset %d' % (name, opset))
    return model


def one_layer(kind, params='', shape=(2, 3, 5, 6), bottoms=('data',), extra_inputs=''):
    return (input_layer('data', *shape) + extra_inputs +
            'layer { name: "l" type: "%s" %s top: "y" %s }' % (
                kind, ' '.join('bottom: "%s"' % b for b in bottoms), params))


def positive(rng, shape):
    return rng.uniform(0.1, 2.0, shape)


def small_integers(rng, shape):
    """Values with many ties."""
    return rng.integers(0, 3, shape)


NEURONS = {
    'power_square': ('Power', 'power_param { power: 2 scale: 0.5 shift: 1 }', None),
    'power_cube_root': ('Power', 'power_param { power: 0.333 scale: 2 shift: 0.5 }', positive),
    'power_scale_0': ('Power', 'power_param { power: 3 scale: 0 shift: 2 }', None),
    'power_0': ('Power', 'power_param { power: 0 scale: 3 }', None),
    'power_identity': ('Power', '', None),
    'exp_e_shift': ('Exp', 'exp_param { scale: 0.5 shift: 0.3 }', None),
    'exp_base_3': ('Exp', 'exp_param { base: 3 scale: -0.7 }', None),
    'log_base_2': ('Log', 'log_param { base: 2 scale: 2 shift: 0.5 }', positive),
    'log_e': ('Log', 'log_param { scale: 0.5 }', positive),
    'threshold': ('Threshold', 'threshold_param { threshold: 0.25 }', None),
    'threshold_ties': ('Threshold', 'threshold_param { threshold: 1 }', small_integers),
    'swish': ('Swish', 'swish_param { beta: 0.7 }', None),
    'elu': ('ELU', 'elu_param { alpha: 0.3 }', None),
    'bnll': ('BNLL', '', lambda rng, shape: 30 * rng.standard_normal(shape)),
    'clip': ('Clip', 'clip_param { min: -0.2 max: 0.9 }', None),
    'leaky_relu': ('ReLU', 'relu_param { negative_slope: -0.3 }', None),
    'dropout': ('Dropout', 'dropout_param { dropout_ratio: 0.4 }', None),
    'softmax_axis_3': ('Softmax', 'softmax_param { axis: -1 }', None),
}


@pytest.mark.parametrize('case', sorted(NEURONS))
def test_element_wise_rule(case):
    kind, params, inputs = NEURONS[case]
    check(one_layer(kind, params), inputs)


def test_neurons_in_place_on_one_blob():
    """Caffe writes 'h' four times; ONNX gets four tensors and the last one is named 'h'."""
    text = (input_layer('data', 2, 3, 4, 4) +
            'layer { name: "conv" type: "Convolution" bottom: "data" top: "h" '
            '  convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }'
            'layer { name: "scale" type: "Scale" bottom: "h" top: "h" '
            '  scale_param { bias_term: true } }'
            'layer { name: "relu" type: "ReLU" bottom: "h" top: "h" }'
            'layer { name: "drop" type: "Dropout" bottom: "h" top: "h" }')
    model = check(text)
    assert [o.name for o in model.graph.output] == ['h']
    assert [n.name for n in model.graph.node] == ['conv', 'scale/Mul', 'scale', 'relu',
                                                  'h/output']


def test_prelu_on_2d_and_shared():
    check(one_layer('PReLU', shape=(4, 5)))
    check(one_layer('PReLU', 'prelu_param { channel_shared: true }', shape=(2, 3, 4)))


ARGMAX = {
    'no_axis_top3_values': 'argmax_param { top_k: 3 out_max_val: true }',
    'no_axis_top1': 'argmax_param { }',
    'axis_2_top_2': 'argmax_param { axis: 2 top_k: 2 }',
    'axis_minus_1_values': 'argmax_param { axis: -1 top_k: 4 out_max_val: true }',
    'axis_1': 'argmax_param { axis: 1 }',
}


@pytest.mark.parametrize('case', sorted(ARGMAX))
@pytest.mark.parametrize('inputs', [None, small_integers], ids=['distinct', 'ties'])
def test_argmax(case, inputs):
    # on ties Caffe (and our layer) report the larger index
    check(one_layer('ArgMax', ARGMAX[case]), inputs)


def test_argmax_of_a_2d_blob():
    check(one_layer('ArgMax', 'argmax_param { top_k: 2 out_max_val: true }', shape=(3, 7)),
          small_integers)


SHAPES = {
    'reshape_insert_axis': ('Reshape', 'reshape_param { shape { dim: 1 } axis: 1 num_axes: 0 }'),
    'reshape_append_axes': ('Reshape', 'reshape_param { shape { dim: 1 dim: 1 } axis: -1 '
                                       'num_axes: 0 }'),
    'reshape_copy_and_infer': ('Reshape', 'reshape_param { shape { dim: 0 dim: -1 dim: 2 } }'),
    'reshape_middle': ('Reshape', 'reshape_param { shape { dim: 15 } axis: 1 num_axes: 2 }'),
    'reshape_whole': ('Reshape', 'reshape_param { shape { dim: -1 } }'),
    'flatten_from_2': ('Flatten', 'flatten_param { axis: 2 }'),
    'flatten_0_to_1': ('Flatten', 'flatten_param { axis: 0 end_axis: 1 }'),
    'flatten_1_to_2': ('Flatten', 'flatten_param { axis: 1 end_axis: -2 }'),
    'tile_axis_3': ('Tile', 'tile_param { axis: 3 tiles: 2 }'),
    'reduction_mean_axis_2': ('Reduction', 'reduction_param { operation: MEAN axis: 2 coeff: 2 }'),
    'reduction_asum_all': ('Reduction', 'reduction_param { operation: ASUM }'),
}


@pytest.mark.parametrize('case', sorted(SHAPES))
def test_shape_rule(case):
    check(one_layer(*SHAPES[case], shape=(2, 3, 5, 2)))


def test_slice_variants():
    check(input_layer('data', 2, 3, 6, 4) +
          'layer { name: "s" type: "Slice" bottom: "data" top: "a" top: "b" top: "c" '
          '  slice_param { axis: 2 slice_point: 1 slice_point: 4 } }')
    check(input_layer('data', 2, 3, 6, 4) +
          'layer { name: "s" type: "Slice" bottom: "data" top: "a" top: "b" '
          '  slice_param { slice_dim: 3 } }')
    check(input_layer('data', 2, 3, 6, 4) +
          'layer { name: "s" type: "Slice" bottom: "data" top: "a" slice_param { axis: 1 } }')


def test_concat_legacy_dim_and_crop_offsets():
    check(input_layer('data', 2, 3, 6, 7) + input_layer('other', 2, 3, 2, 7) +
          'layer { name: "c" type: "Concat" bottom: "data" bottom: "other" top: "y" '
          '  concat_param { concat_dim: 2 } }')
    two = input_layer('data', 2, 5, 6, 7) + input_layer('ref', 2, 3, 4, 2)
    check(two + 'layer { name: "c" type: "Crop" bottom: "data" bottom: "ref" top: "y" '
                '  crop_param { axis: 1 offset: 1 offset: 2 offset: 3 } }')
    check(two + 'layer { name: "c" type: "Crop" bottom: "data" bottom: "ref" top: "y" '
                '  crop_param { axis: -3 offset: 1 } }')


CONVOLUTIONS = {
    'repeated_values_groups': 'convolution_param { num_output: 6 group: 3 kernel_size: 3 '
                              'kernel_size: 2 pad: 1 pad: 0 stride: 2 stride: 1 dilation: 1 '
                              'dilation: 2 bias_term: false }',
    'kernel_h_w': 'convolution_param { num_output: 4 kernel_h: 1 kernel_w: 3 pad_h: 0 pad_w: 2 '
                  'stride_h: 2 stride_w: 3 }',
    'depthwise_dilated': 'convolution_param { num_output: 3 group: 3 kernel_size: 3 pad: 2 '
                         'dilation: 2 }',
}


@pytest.mark.parametrize('case', sorted(CONVOLUTIONS))
@pytest.mark.parametrize('kind', ['Convolution', 'Deconvolution'])
def test_convolution(kind, case):
    check(one_layer(kind, CONVOLUTIONS[case], shape=(2, 3, 7, 8)))


def test_convolution_shares_weights_over_bottom_pairs():
    check(input_layer('data', 2, 3, 7, 8) + input_layer('more', 2, 3, 7, 8) +
          'layer { name: "c" type: "Convolution" bottom: "data" bottom: "more" top: "y" top: "z" '
          '  convolution_param { num_output: 2 kernel_size: 3 } }')


@pytest.mark.parametrize('params', [
    'inner_product_param { num_output: 5 axis: 2 transpose: true }',
    'inner_product_param { num_output: 4 axis: -1 bias_term: false }',
    'inner_product_param { num_output: 3 transpose: true }',
], ids=['axis_2_transpose', 'axis_minus_1', 'transpose'])
def test_inner_product(params):
    check(one_layer('InnerProduct', params, shape=(2, 3, 4, 6)))


@pytest.mark.parametrize('params, shape', [
    ('scale_param { axis: 2 num_axes: 1 }', (2, 3, 4, 5)),
    ('scale_param { axis: -3 num_axes: 2 bias_term: true }', (2, 3, 4, 5)),
    ('scale_param { axis: 0 num_axes: -1 }', (2, 3)),
    ('scale_param { num_axes: 0 bias_term: true }', (2, 3, 4)),
], ids=['axis_2', 'axis_minus_3_bias', 'all_axes', 'scalar_bias'])
def test_scale(params, shape):
    check(one_layer('Scale', params, shape=shape))


def test_scale_and_bias_with_a_second_bottom():
    factor = input_layer('factor', 3, 4)
    check(one_layer('Scale', 'scale_param { axis: 1 bias_term: true }', shape=(2, 3, 4, 5),
                    bottoms=('data', 'factor'), extra_inputs=factor))
    check(one_layer('Bias', 'bias_param { axis: 1 }', shape=(2, 3, 4, 5),
                    bottoms=('data', 'factor'), extra_inputs=factor))
    check(one_layer('Bias', 'bias_param { axis: 2 num_axes: 2 }', shape=(2, 3, 4, 5)))


def test_lrn_across_channels_with_k():
    check(one_layer('LRN', 'lrn_param { local_size: 3 alpha: 0.7 beta: 0.6 k: 2 }'))


def test_batch_norm_with_batch_statistics_in_test():
    """use_global_stats: false normalizes with the batch's own statistics even in TEST."""
    check(one_layer('BatchNorm', 'batch_norm_param { use_global_stats: false eps: 0.001 }'))


def stats_inputs(rng, shape):
    return rng.normal(3.0, 2.0, shape)


@pytest.mark.parametrize('kind, blobs', [
    ('BatchNorm', lambda rng, c: [rng.normal(3, 1, c) * 0.7, rng.uniform(1, 6, c) * 0.7, [0.7]]),
    ('BN', lambda rng, c: [rng.uniform(0.5, 1.5, (1, c, 1, 1)), rng.normal(0, 1, (1, c, 1, 1)),
                           rng.normal(3, 1, (1, c, 1, 1)), rng.uniform(1, 6, (1, c, 1, 1))]),
    ('SyncBN', lambda rng, c: [rng.uniform(0.5, 1.5, (1, c, 1, 1)), rng.normal(0, 1, (1, c, 1, 1)),
                               rng.normal(3, 1, (1, c, 1, 1)), rng.uniform(1, 6, (1, c, 1, 1))]),
])
@pytest.mark.parametrize('shape', [(2, 3, 4, 5), (4, 3)], ids=['4d', '2d'])
def test_batch_norms_with_stored_statistics(kind, blobs, shape):
    param, net, feeds = build(one_layer(kind, shape=shape), inputs=stats_inputs)
    rng = np.random.default_rng(1)
    for blob, value in zip(net.params['l'], blobs(rng, shape[1])):
        blob.data[...] = np.reshape(value, blob.shape)
    expected = net.forward(**feeds)['y']
    assert_close(run(to_onnx(param, weights_of(net)), feeds)['y'], expected, kind)


def test_embed_and_batch_reindex():
    table = one_layer('Embed', 'embed_param { num_output: 3 input_dim: 5 }', shape=(2, 4))
    check(table, lambda rng, shape: rng.integers(0, 5, shape))
    text = (input_layer('data', 4, 3, 2) + input_layer('index', 5) +
            'layer { name: "r" type: "BatchReindex" bottom: "data" bottom: "index" top: "y" }')
    param, net, feeds = build(text)
    feeds['index'] = np.array([3, 0, 0, 2, 1], np.float32)
    expected = net.forward(**feeds)['y']
    assert_close(run(to_onnx(param), feeds)['y'], expected, 'BatchReindex')


def test_silence_and_split_outputs():
    model = check(input_layer('data', 2, 3) +
                  'layer { name: "a" type: "TanH" bottom: "data" top: "a" }'
                  'layer { name: "s" type: "Split" bottom: "a" top: "b" top: "c" }'
                  'layer { name: "quiet" type: "Silence" bottom: "b" }')
    assert [o.name for o in model.graph.output] == ['c']


# ---- pooling: every small geometry, against our layer ------------------------------------------
def window_outside(method, size, kernel, stride, pad):
    """Whether Caffe's last window starts past the input (MAX) or past its padding (AVE)."""
    span = size + 2 * pad - kernel
    out = -(-span // stride) + 1
    if pad and (out - 1) * stride >= size + pad:
        out -= 1
    start = (out - 1) * stride - pad
    return start >= size + (pad if method == 'AVE' else 0)


def pooling_geometries():
    for method, kernel, stride in itertools.product(('MAX', 'AVE'), (2, 3, 4), (1, 2, 3, 5)):
        for pad_h, pad_w in itertools.product(range(kernel), repeat=2):
            yield method, kernel, stride, pad_h, pad_w


def test_pooling_in_every_small_geometry():
    """One net with a pooling of each geometry on a 7x9 input (kernel 2..4, stride 1..5,
    every pad below the kernel, both methods); those whose last window lies outside the
    input are refused by name, all in one error, and the rest match our layer."""
    height, width = 7, 9
    layers, refused = [], []
    for i, (method, kernel, stride, pad_h, pad_w) in enumerate(pooling_geometries()):
        name = 'p%d' % i
        layers.append('layer { name: "%s" type: "Pooling" bottom: "data" top: "%s" pooling_param '
                      '{ pool: %s kernel_size: %d stride: %d pad_h: %d pad_w: %d } }'
                      % (name, name, method, kernel, stride, pad_h, pad_w))
        if window_outside(method, height, kernel, stride, pad_h) or \
                window_outside(method, width, kernel, stride, pad_w):
            refused.append(name)
    text = input_layer('data', 2, 2, height, width) + '\n'.join(layers)
    assert 0 < len(refused) < len(layers) // 4
    with pytest.raises(CaffeError) as error:
        to_onnx(parse(text))
    assert sorted(re.findall(r"'(p\d+)' \(Pooling\)", str(error.value))) == sorted(refused)
    kept = [layer for layer, i in zip(layers, range(len(layers))) if 'p%d' % i not in refused]
    check(input_layer('data', 2, 2, height, width) + '\n'.join(kept))


def test_pooling_variants():
    check(one_layer('Pooling', 'pooling_param { pool: MAX global_pooling: true }')
          .replace('top: "y"', 'top: "y" top: "mask"'))
    check(one_layer('Pooling', 'pooling_param { pool: STOCHASTIC kernel_size: 2 stride: 2 }'),
          positive)
    check(one_layer('Pooling', 'pooling_param { pool: AVE kernel_h: 3 kernel_w: 2 stride_h: 2 '
                               'stride_w: 1 pad_w: 1 round_mode: FLOOR }'))
    check(one_layer('SPP', 'spp_param { pyramid_height: 1 pool: AVE }'))
    check(one_layer('SPP', 'spp_param { pyramid_height: 2 pool: MAX }', shape=(2, 3, 5, 3)))


# ---- dynamic batch and input shapes ------------------------------------------------------------
DYNAMIC_NET = input_layer('data', 1, 3, 8, 8) + input_layer('factor', 1, 4) + '''
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv"
        batch_norm_param { use_global_stats: false } }
layer { name: "scale" type: "Scale" bottom: "conv" bottom: "factor" top: "scaled"
        scale_param { axis: 0 num_axes: 2 } }
layer { name: "zoom" type: "Interp" bottom: "scaled" top: "zoom"
        interp_param { zoom_factor: 2 pad_beg: -1 } }
layer { name: "pool" type: "Pooling" bottom: "zoom" top: "pool"
        pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "slice" type: "Slice" bottom: "pool" top: "left" top: "right"
        slice_param { axis: 1 slice_point: 1 } }
layer { name: "flat" type: "Flatten" bottom: "left" top: "flat" }
layer { name: "ip" type: "InnerProduct" bottom: "flat" top: "ip"
        inner_product_param { num_output: 6 } }
layer { name: "fold" type: "Reshape" bottom: "ip" top: "fold"
        reshape_param { shape { dim: -1 dim: 2 dim: 3 } } }
layer { name: "arg" type: "ArgMax" bottom: "right" top: "arg" argmax_param { top_k: 2 } }
layer { name: "power" type: "Power" bottom: "right" top: "ones" power_param { power: 0 } }
'''


@pytest.mark.parametrize('opset', OPSETS)
def test_dynamic_batch(opset):
    """Exported at batch 1 with a symbolic batch, run at batch 3: equals our forward there."""
    param, net, _ = build(DYNAMIC_NET)
    model = to_onnx(param, weights_of(net), opset=opset, dynamic_batch=True)
    assert all(v.type.tensor_type.shape.dim[0].dim_param == 'batch'
               for v in list(model.graph.input) + list(model.graph.output))
    rng = np.random.default_rng(3)
    feeds = {'data': rng.standard_normal((3, 3, 8, 8)), 'factor': rng.standard_normal((3, 4))}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    expected = {k: np.array(v) for k, v in net.forward(**feeds).items()}
    outputs = run(model, feeds)
    assert sorted(outputs) == sorted(expected)
    for name, value in outputs.items():
        assert_close(value, expected[name], name)


def test_input_shapes_override_one_top_of_a_shared_shape():
    text = ('layer { name: "in" type: "Input" top: "a" top: "b" '
            '  input_param { shape { dim: 2 dim: 3 } } }'
            'layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "a" top: "twice" }'
            'layer { name: "t" type: "TanH" bottom: "b" top: "t" }')
    model = to_onnx(parse(text), input_shapes={'a': (4, 5)})
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    assert dims == {'a': [4, 5], 'b': [2, 3]}
    x = np.ones((4, 5), np.float32)
    outputs = run(model, {'a': x, 'b': np.zeros((2, 3), np.float32)})
    assert_close(outputs['twice'], 2 * x, 'twice')
