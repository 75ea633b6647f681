"""Layers that move values (Split, Concat, Slice, Flatten, Reshape, Tile, Crop, Silence,
BatchReindex, Filter, Parameter): Caffe's golden outputs on every engine (the engine
fixture), finite-difference gradients and Caffe's corner cases. SSD's Permute:
test_detection.py; ShuffleNet's ShuffleChannel: test_fork_layers.py."""
import numpy as np
import pytest

from caffe_syncbn.blob import Blob
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.testing import build_layer, check_gradient, layer_param
from helpers.golden_layer_case import net_layer_cases, run_net_layer_case
from helpers.layer_checks import RS, forward

TYPES = ['Split', 'Concat', 'Slice', 'Flatten', 'Reshape', 'Tile', 'Crop', 'Silence',
         'BatchReindex', 'Filter', 'Parameter']


@pytest.mark.parametrize('case_name, layer_name', net_layer_cases(TYPES))
def test_golden(case_name, layer_name, engine):
    run_net_layer_case(case_name, layer_name, engine)


GRADIENTS = [
    ("type: 'Split' bottom: 'x' top: 'a' top: 'b' top: 'c'", [RS.randn(2, 3)], None),
    ("type: 'Concat' bottom: 'a' bottom: 'b' bottom: 'c' top: 'y'",
     [RS.randn(2, 1, 3), RS.randn(2, 2, 3), RS.randn(2, 3, 3)], None),
    ("type: 'Concat' bottom: 'a' bottom: 'b' top: 'y' concat_param { axis: -1 }",
     [RS.randn(2, 3, 1), RS.randn(2, 3, 2)], None),
    ("type: 'Concat' bottom: 'a' bottom: 'b' top: 'y' concat_param { concat_dim: 0 }",
     [RS.randn(1, 3), RS.randn(2, 3)], None),
    ("type: 'Slice' bottom: 'x' top: 'a' top: 'b' top: 'c' slice_param { slice_point: 1 "
     "slice_point: 3 }", [RS.randn(2, 6, 2)], None),
    ("type: 'Slice' bottom: 'x' top: 'a' top: 'b' slice_param { axis: 2 }",
     [RS.randn(2, 3, 4)], None),
    ("type: 'Slice' bottom: 'x' top: 'a' top: 'b' slice_param { slice_dim: 0 }",
     [RS.randn(4, 3)], None),
    ("type: 'Flatten' bottom: 'x' top: 'y'", [RS.randn(2, 3, 2, 2)], None),
    ("type: 'Flatten' bottom: 'x' top: 'y' flatten_param { axis: 1 end_axis: 2 }",
     [RS.randn(2, 3, 2, 2)], None),
    ("type: 'Reshape' bottom: 'x' top: 'y' reshape_param { shape { dim: 0 dim: -1 dim: 2 } }",
     [RS.randn(2, 3, 2, 2)], None),
    ("type: 'Reshape' bottom: 'x' top: 'y' reshape_param { axis: 1 num_axes: 1 "
     "shape { dim: 2 dim: 3 } }", [RS.randn(2, 6, 2)], None),
    ("type: 'Tile' bottom: 'x' top: 'y' tile_param { tiles: 3 }", [RS.randn(2, 2, 3)], None),
    ("type: 'Tile' bottom: 'x' top: 'y' tile_param { axis: -1 tiles: 2 }",
     [RS.randn(2, 2, 3)], None),
    ("type: 'Crop' bottom: 'x' bottom: 'r' top: 'y' crop_param { offset: 1 offset: 2 }",
     [RS.randn(2, 2, 5, 6), RS.randn(2, 2, 3, 3)], [0]),
    ("type: 'Crop' bottom: 'x' bottom: 'r' top: 'y' crop_param { axis: 1 offset: 1 }",
     [RS.randn(2, 3, 4), RS.randn(2, 2, 2)], [0]),
    ("type: 'Crop' bottom: 'x' bottom: 'r' top: 'y' crop_param { axis: 2 }",   # all of it
     [RS.randn(2, 2, 3, 4), RS.randn(2, 2, 3, 4)], [0]),
    ("type: 'Silence' bottom: 'x' bottom: 'z'", [RS.randn(2, 3), RS.randn(3)], None),
    ("type: 'BatchReindex' bottom: 'x' bottom: 'i' top: 'y'",
     [RS.randn(4, 2, 3), np.array([3., 0, 0, 2, 1, 3])], [0]),
    ("type: 'Filter' bottom: 'x' bottom: 't' bottom: 's' top: 'xf' top: 'tf'",
     [RS.randn(5, 2, 3), RS.randn(5, 2), np.array([1., 0, 1, 1, 0])], [0, 1]),
    ("type: 'Parameter' top: 'p' parameter_param { shape { dim: 2 dim: 3 } }", [], None),
]


@pytest.mark.parametrize('text, bottoms, check_bottom', GRADIENTS,
                         ids=[t[:60] for t, _, _ in GRADIENTS])
def test_shape_gradient(text, bottoms, check_bottom):
    check_gradient("name: 'l' " + text, bottoms, check_bottom=check_bottom)


def test_filter_first_reshape_keeps_the_batch_size():
    text = "name: 'f' type: 'Filter' bottom: 'x' bottom: 's' top: 'y'"
    layer, bottom, top = build_layer(text, [np.arange(4.).reshape(4, 1), np.zeros(4)])
    assert top[0].shape == (4, 1)
    bottom[1].data[...] = [0, 1, 0, 1]
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data.ravel(), [1, 3])
    assert not layer.allow_force_backward(1) and layer.allow_force_backward(0)


def test_reshape_and_flatten_share_data():
    x = RS.randn(2, 3, 4)
    layer, bottom, top = forward("name: 'r' type: 'Reshape' bottom: 'x' top: 'y' "
                                 "reshape_param { shape { dim: -1 dim: 4 } }", [x])
    assert top[0].shape == (6, 4)
    bottom[0].data[0, 0, 0] = 42
    assert top[0].data[0, 0] == 42


@pytest.mark.parametrize('text, bottoms, message', [
    ("type: 'Concat' bottom: 'a' bottom: 'b' top: 'y'", [np.zeros((2, 3, 4)), np.zeros((2, 3, 5))],
     'must match except on axis 1'),
    ("type: 'Slice' bottom: 'x' top: 'a' top: 'b'", [np.zeros((2, 3))], 'does not split equally'),
    ("type: 'Reshape' bottom: 'x' top: 'y' reshape_param { shape { dim: 5 dim: -1 } }",
     [np.zeros((2, 3))], 'cannot infer'),
    ("type: 'Crop' bottom: 'x' bottom: 'r' top: 'y' crop_param { offset: 2 }",
     [np.zeros((1, 1, 4, 4)), np.zeros((1, 1, 3, 3))], 'too small'),
    ("type: 'BatchReindex' bottom: 'x' bottom: 'i' top: 'y'", [np.zeros((2, 3)), np.array([2.])],
     'indices must be in'),
])
def test_bad_input_names_the_layer(text, bottoms, message):
    with pytest.raises(CaffeError, match=message) as info:
        forward("name: 'bad' " + text, bottoms)
    assert "'bad'" in str(info.value)


def test_parameter_top_is_the_blob():
    layer, _, top = build_layer(layer_param("name: 'p' type: 'Parameter' top: 'p' "
                                            "parameter_param { shape { dim: 2 } }"), [])
    layer.blobs[0].data[...] = [1, 2]
    layer.forward([], top)
    np.testing.assert_array_equal(top[0].data, [1, 2])
    assert isinstance(top[0], Blob)
