"""The other forks' layers out of the package: their ONNX rules run in onnxruntime against
our forward, OpenCV 4 reads and runs the ones it knows, and their parameters sit at the
forks' field numbers."""
import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from helpers.onnx_helpers import (assert_close, highest_common_opset, input_layer, parse, run,
                                  weights_of)


def test_fork_fields_have_the_fork_numbers():
    fields = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    numbers = {name: fields[name].number for name in (
        'upsample_param', 'shuffle_channel_param', 'roi_pooling_param', 'smooth_l1_loss_param')}
    assert numbers == {'upsample_param': 149, 'shuffle_channel_param': 164,
                       'roi_pooling_param': 8266711, 'smooth_l1_loss_param': 8266712}
    every = [f.number for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields]
    assert len(every) == len(set(every))


def test_upsample_settings_of_a_yolov3_caffemodel_read_back():
    """darknet2caffe's YOLO Caffe writes upsample_param { scale } as field 149, field 1 inside."""
    layer = caffe_pb2.LayerParameter(name='up', type='Upsample')
    layer.upsample_param.scale = 2
    assert layer.SerializeToString().endswith(bytes([0xaa, 0x09, 0x02, 0x08, 0x02]))


NET = input_layer('data', 2, 6, 5, 7)


def layer(kind, params='', bottoms=('data',), top='y'):
    return 'layer { name: "l_%s" type: "%s" %s top: "%s" %s }\n' % (
        top, kind, ' '.join('bottom: "%s"' % b for b in bottoms), top, params)


DEPTHWISE = 'convolution_param { num_output: 6 group: 6 kernel_size: 3 pad: 1 stride: 2 }'
EXPORTED = {
    'ConvolutionDepthwise': NET + layer('ConvolutionDepthwise', DEPTHWISE),
    'DepthwiseConvolution': NET + layer('DepthwiseConvolution', DEPTHWISE),
    'ShuffleChannel': NET + layer('ShuffleChannel', 'shuffle_channel_param { group: 3 }'),
    'ShuffleChannel 3-D': input_layer('data', 2, 6, 5) +
    layer('ShuffleChannel', 'shuffle_channel_param { group: 2 }'),
    'Axpy': NET + input_layer('a', 2, 6, 1, 1) + input_layer('b', 2, 6, 5, 7) +
    layer('Axpy', bottoms=('a', 'data', 'b')),
    'Axpy (N, C)': NET + input_layer('a', 2, 6) + input_layer('b', 2, 6, 5, 7) +
    layer('Axpy', bottoms=('a', 'data', 'b')),
    'Upsample nearest': NET + layer('Upsample', 'upsample_param { scale: 3 }'),
    'ReLU6': NET + layer('Power', 'power_param { scale: 4 }', top='big') +
    layer('ReLU6', bottoms=('big',)),
    'ReLU6 with a negative slope': NET + layer('Power', 'power_param { scale: 4 }', top='big') +
    layer('ReLU6', 'relu_param { negative_slope: 0.25 }', bottoms=('big',)),
    'Pooling ceil_mode: false': NET + layer(
        'Pooling', 'pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 ceil_mode: false }'),
}


@pytest.fixture(scope='module')
def to_onnx():
    pytest.importorskip('onnx', reason="ONNX export needs onnx: pip install '.[onnx]'")
    pytest.importorskip('onnxruntime', reason='pip install onnxruntime')
    from caffe_syncbn.export import to_onnx
    return to_onnx


@pytest.mark.parametrize('case', sorted(EXPORTED))
def test_onnx_export_matches_our_forward(to_onnx, case):
    param = parse(EXPORTED[case])
    net = caffe.Net(param, caffe.TEST)
    rng = np.random.default_rng(3)
    for blobs in net.params.values():
        for blob in blobs:
            blob.data[...] = rng.standard_normal(blob.shape)
    feeds = {name: rng.standard_normal(net.blobs[name].shape).astype(np.float32)
             for name in net.inputs}
    expected = np.array(net.forward(**feeds)['y'])
    for opset in sorted({17, highest_common_opset()}):
        outputs = run(to_onnx(param, weights_of(net), opset=opset), feeds)
        assert_close(outputs['y'], expected, '%s at opset %d' % (case, opset))


def test_onnx_refuses_segnet_unpooling_in_one_line(to_onnx):
    text = (NET + 'layer { name: "pool" type: "Pooling" bottom: "data" top: "p" top: "mask" '
            'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }\n' +
            layer('Upsample', 'upsample_param { upsample_h: 5 upsample_w: 7 }',
                  bottoms=('p', 'mask')))
    with pytest.raises(CaffeError) as info:
        to_onnx(parse(text))
    message = str(info.value)
    assert '\n' not in message
    assert "'l_y' (Upsample): SegNet's unpooling by a pooling mask has no exact ONNX form" \
        in message


# ---- OpenCV ----------------------------------------------------------------------------------
OPENCV_NET = '''name: "forks"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 6 dim: 9 dim: 7 } } }
layer { name: "dw" type: "ConvolutionDepthwise" bottom: "data" top: "dw"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 stride: 2 } }
layer { name: "shuffle" type: "ShuffleChannel" bottom: "dw" top: "shuffle"
        shuffle_channel_param { group: 3 } }
layer { name: "pool" type: "Pooling" bottom: "shuffle" top: "gate"
        pooling_param { pool: AVE global_pooling: true } }
layer { name: "axpy" type: "Axpy" bottom: "gate" bottom: "shuffle" bottom: "dw" top: "axpy" }
'''


def test_opencv_runs_convolution_depthwise_shuffle_channel_and_axpy(tmp_path):
    """OpenCV 4 maps ConvolutionDepthwise to a grouped Convolution and Axpy to Scale and
    Eltwise, and has a ShuffleChannel of its own. Its Axpy scales bottom 2 and adds bottom 1,
    the other way round from SENet's layer (a * bottom 1 + bottom 2), which this package
    follows; see docs/fork-layers.md."""
    cv2 = pytest.importorskip('cv2', reason='pip install "opencv-python-headless<5"')
    prototxt = tmp_path / 'forks.prototxt'
    prototxt.write_text(OPENCV_NET)
    net = caffe.Net(str(prototxt), caffe.TEST)
    rng = np.random.default_rng(5)
    for blobs in net.params.values():
        for blob in blobs:
            blob.data[...] = rng.standard_normal(blob.shape)
    weights = tmp_path / 'forks.caffemodel'
    net.save(str(weights))
    x = rng.standard_normal((1, 6, 9, 7)).astype(np.float32)
    net.forward(data=x)
    ours = {name: np.array(net.blobs[name].data) for name in ('dw', 'shuffle', 'gate', 'axpy')}
    reference = cv2.dnn.readNetFromCaffe(str(prototxt), str(weights))
    reference.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    reference.setInput(x)
    # OpenCV names its outputs by layer
    dw, shuffle, gate, axpy = reference.forward(['dw', 'shuffle', 'pool', 'axpy'])
    for name, theirs in (('dw', dw), ('shuffle', shuffle), ('gate', gate)):
        np.testing.assert_allclose(theirs, ours[name], rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(axpy, ours['gate'] * ours['dw'] + ours['shuffle'],
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours['axpy'], ours['gate'] * ours['shuffle'] + ours['dw'],
                               rtol=1e-6, atol=1e-6)


ROI_NET = '''name: "roi"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 7 dim: 9 } } }
layer { name: "rois" type: "Input" top: "rois" input_param { shape { dim: 6 dim: 5 } } }
layer { name: "roi_pool" type: "ROIPooling" bottom: "data" bottom: "rois" top: "pooled"
        roi_pooling_param { pooled_h: 3 pooled_w: 2 spatial_scale: 0.5 } }
'''


def test_opencv_roi_pooling_agrees(tmp_path):
    """OpenCV's ROIPooling (its Faster R-CNN support) on ROIs that round at .5, cross every
    edge and lie wholly outside (empty bins)."""
    cv2 = pytest.importorskip('cv2', reason='pip install "opencv-python-headless<5"')
    prototxt = tmp_path / 'roi.prototxt'
    prototxt.write_text(ROI_NET)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 7, 9)).astype(np.float32)
    rois = np.array([[0, 0, 0, 12, 8], [1, 5, 3, 5, 3], [1, -7, -3, 30, 21], [0, 40, 40, 50, 60],
                     [1, 3, 1, 9, 13], [0, 1.2, 2.6, 7.4, 11.5]], np.float32)
    ours = np.array(caffe.Net(str(prototxt), caffe.TEST).forward(data=x, rois=rois)['pooled'])
    reference = cv2.dnn.readNetFromCaffe(str(prototxt))
    reference.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    reference.setInput(x, 'data')
    reference.setInput(rois, 'rois')
    np.testing.assert_array_equal(reference.forward('roi_pool'), ours)


FLOOR_NET = '''name: "floor"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 11 } } }
layer { name: "relu6" type: "ReLU6" bottom: "data" top: "relu6" }
layer { name: "max" type: "Pooling" bottom: "relu6" top: "max"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 ceil_mode: false } }
layer { name: "ave" type: "Pooling" bottom: "relu6" top: "ave"
        pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 ceil_mode: false } }
'''


def test_opencv_agrees_on_relu6_and_floor_pooling(tmp_path):
    """OpenCV's reader knows ReLU6 and ceil_mode (pull request 3057's field) natively."""
    cv2 = pytest.importorskip('cv2', reason='pip install "opencv-python-headless<5"')
    prototxt = tmp_path / 'floor.prototxt'
    prototxt.write_text(FLOOR_NET)
    x = (np.random.default_rng(4).standard_normal((1, 3, 8, 11)) * 5).astype(np.float32)
    ours = caffe.Net(str(prototxt), caffe.TEST).forward(data=x, blobs=['relu6', 'max', 'ave'])
    reference = cv2.dnn.readNetFromCaffe(str(prototxt))
    reference.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    reference.setInput(x)
    theirs = reference.forward(['relu6', 'max', 'ave'])
    for name, values in zip(('relu6', 'max', 'ave'), theirs):
        assert values.shape == ours[name].shape, name
        np.testing.assert_allclose(values, ours[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert ours['max'].shape == (1, 3, 3, 5)


PSROI_NET = '''name: "psroi"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 18 dim: 6 dim: 7 } } }
layer { name: "rois" type: "Input" top: "rois" input_param { shape { dim: 6 dim: 5 } } }
layer { name: "psroi" type: "PSROIPooling" bottom: "data" bottom: "rois" top: "pooled"
        psroi_pooling_param { spatial_scale: 0.0625 output_dim: 2 group_size: 3 } }
'''


def test_opencv_psroi_pooling_agrees(tmp_path):
    """OpenCV's PSROIPooling (its R-FCN support) on ROIs that round at .5, cross the edges,
    end before they start and lie wholly outside (empty bins)."""
    cv2 = pytest.importorskip('cv2', reason='pip install "opencv-python-headless<5"')
    prototxt = tmp_path / 'psroi.prototxt'
    prototxt.write_text(PSROI_NET)
    x = np.random.default_rng(2).standard_normal((2, 18, 6, 7)).astype(np.float32)
    rois = np.array([[1, 2.5, 3.5, 40.5, 60.5], [0, -30, -30, 200, 200], [1, 50, 40, 20, 10],
                     [0, 95, 100, 95, 100], [1, 200, 200, 300, 300],
                     [1, -5.5, 7.49, 33.51, 80]], np.float32)
    ours = np.array(caffe.Net(str(prototxt), caffe.TEST).forward(data=x, rois=rois)['pooled'])
    reference = cv2.dnn.readNetFromCaffe(str(prototxt))
    reference.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    reference.setInput(x, 'data')
    reference.setInput(rois, 'rois')
    np.testing.assert_allclose(reference.forward('psroi'), ours, rtol=1e-6, atol=1e-6)
