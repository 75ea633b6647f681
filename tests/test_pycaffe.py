"""The pycaffe module piece by piece: caffe.io against OpenCV and numpy, the Net's batch
helpers against single forwards, share_with, Blob's legacy accessors, NetSpec's errors,
coord_map's rules, solvers' callbacks, install_as_caffe and set_mode_gpu's error."""
import builtins
import sys

import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.pycaffe import coord_map, io as caffe_io
from caffe_syncbn.pycaffe.net_spec import NetSpec, layers as L, params as P

IP_NET = """name: 'ipnet' force_backward: true
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 4 dim: 3 dim: 2 dim: 2 } } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'data' top: 'ip'
        inner_product_param { num_output: 5 weight_filler { type: 'gaussian' std: 1 } } }
layer { name: 'prob' type: 'Softmax' bottom: 'ip' top: 'prob' }
"""


def ip_net(tmp_path, text=IP_NET):
    path = tmp_path / 'net.prototxt'
    path.write_text(text)
    return caffe.Net(str(path), caffe.TEST)


# ---- caffe.io -------------------------------------------------------------------------------
@pytest.mark.parametrize('shape,new', [((5, 7, 3), (10, 14)), ((9, 8, 2), (4, 3)), ((6, 6, 1), (13, 5))])
def test_resize_image_is_opencv_bilinear(shape, new):
    cv2 = pytest.importorskip('cv2')
    im = np.random.RandomState(0).rand(*shape).astype(np.float32)
    ours = caffe_io.resize_image(im, new)
    theirs = cv2.resize(im, (new[1], new[0]), interpolation=cv2.INTER_LINEAR).reshape(new + shape[2:])
    assert ours.dtype == np.float32 and ours.shape == new + shape[2:]
    np.testing.assert_allclose(ours, theirs, atol=1e-6)
    # nearest: scikit-image's (pycaffe's) rule, SciPy's zoom on the pixel grid; OpenCV's
    # INTER_NEAREST_EXACT differs only where a source position falls exactly between two pixels
    ndimage = pytest.importorskip('scipy.ndimage')
    nearest = caffe_io.resize_image(im, new, interp_order=0)
    factors = (new[0] / shape[0], new[1] / shape[1], 1)
    np.testing.assert_array_equal(nearest, ndimage.zoom(im, factors, order=0, mode='nearest',
                                                        grid_mode=True))


def test_resize_image_many_channels_and_spline_orders():
    im = np.random.RandomState(1).rand(6, 5, 7)
    assert caffe_io.resize_image(im, (12, 10)).shape == (12, 10, 7)
    np.testing.assert_allclose(caffe_io.resize_image(np.full((3, 4, 7), 2.5), (8, 9)), 2.5)
    pytest.importorskip('scipy')
    cubic = caffe_io.resize_image(im, (12, 10), interp_order=3)
    assert cubic.shape == (12, 10, 7) and np.abs(cubic - caffe_io.resize_image(im, (12, 10))).max() < 0.5


def test_load_image(tmp_path):
    cv2 = pytest.importorskip('cv2')
    rng = np.random.RandomState(2)
    bgra = (rng.rand(6, 5, 4) * 255).astype(np.uint8)
    cv2.imwrite(str(tmp_path / 'c.png'), bgra)
    cv2.imwrite(str(tmp_path / 'g.png'), bgra[:, :, 0])
    cv2.imwrite(str(tmp_path / 'w.png'), (bgra[:, :, :3].astype(np.uint16) * 257))
    rgb = caffe_io.load_image(tmp_path / 'c.png')
    assert rgb.dtype == np.float32 and rgb.shape == (6, 5, 3)
    np.testing.assert_allclose(rgb, bgra[:, :, 2::-1] / 255.0, atol=1e-7)
    np.testing.assert_allclose(caffe_io.load_image(tmp_path / 'w.png'), rgb, atol=1e-7)   # 16 bits
    gray = caffe_io.load_image(tmp_path / 'g.png')
    np.testing.assert_allclose(gray, np.repeat(bgra[:, :, :1] / 255.0, 3, axis=2), atol=1e-7)
    assert caffe_io.load_image(tmp_path / 'g.png', color=False).shape == (6, 5, 1)
    alpha = bgra[:, :, 3:] / 255.0
    on_white = bgra[:, :, 2::-1] / 255.0 * alpha + (1 - alpha)
    np.testing.assert_allclose(caffe_io.load_image(tmp_path / 'c.png', color=False)[:, :, 0],
                               on_white @ [0.2125, 0.7154, 0.0721], atol=1e-6)
    with pytest.raises(CaffeError, match='missing.png'):
        caffe_io.load_image(tmp_path / 'missing.png')


def test_oversample_crop_order():
    images = np.arange(2 * 7 * 9 * 2, dtype=np.float32).reshape(2, 7, 9, 2)
    crops = caffe_io.oversample(images, (4, 5))
    assert crops.shape == (20, 4, 5, 2) and crops.dtype == np.float32
    for n, im in enumerate(images):
        expected = [im[0:4, 0:5], im[0:4, 4:9], im[3:7, 0:5], im[3:7, 4:9], im[1:5, 2:7]]
        expected += [crop[:, ::-1] for crop in expected]
        np.testing.assert_array_equal(crops[10 * n:10 * n + 10], expected)
    with pytest.raises(CaffeError):
        caffe_io.oversample(images, (8, 5))


def test_transformer_steps_and_inverse():
    shape = (1, 3, 4, 6)
    t = caffe_io.Transformer({'data': shape})
    t.set_transpose('data', (2, 0, 1))
    t.set_channel_swap('data', (2, 1, 0))
    t.set_raw_scale('data', 255.0)
    t.set_mean('data', np.array([10.0, 20.0, 30.0]))
    t.set_input_scale('data', 0.5)
    image = np.random.RandomState(3).rand(4, 6, 3).astype(np.float32)
    kept = image.copy()
    x = t.preprocess('data', image)
    expected = (image[:, :, ::-1].transpose(2, 0, 1) * 255 - np.array([10, 20, 30.])[:, None, None]) * 0.5
    np.testing.assert_allclose(x, expected, rtol=1e-6)
    np.testing.assert_array_equal(image, kept)                 # the caller's array is untouched
    np.testing.assert_allclose(t.deprocess('data', x[None]), image, atol=1e-6)
    np.testing.assert_allclose(t.preprocess('data', caffe_io.resize_image(image, (8, 3))).shape, (3, 4, 6))


def test_transformer_mean_forms_and_errors():
    t = caffe_io.Transformer({'data': (1, 3, 4, 6)})
    mean = np.random.RandomState(4).rand(3, 8, 12)
    t.set_mean('data', mean)
    np.testing.assert_allclose(t.mean['data'], caffe_io.resize_image(mean.transpose(1, 2, 0), (4, 6))
                               .transpose(2, 0, 1), atol=1e-6)
    one = caffe_io.Transformer({'data': (1, 1, 4, 6)})
    one.set_mean('data', np.ones((4, 6)))
    assert one.mean['data'].shape == (1, 4, 6)
    for call, args in ((t.set_mean, (np.ones(4),)), (t.set_mean, (np.ones((2, 4, 6)),)),
                       (t.set_transpose, ((1, 0),)), (t.set_channel_swap, ((1, 0),))):
        with pytest.raises(ValueError):        # a CaffeError, and the ValueError pycaffe raised
            call('data', *args)
    with pytest.raises(CaffeError, match="'label' is not one of the net inputs"):
        t.preprocess('label', np.zeros((4, 6, 3)))


def test_datum_and_blobproto_helpers():
    u8 = (np.random.RandomState(5).rand(3, 4, 5) * 255).astype(np.uint8)
    datum = caffe_io.array_to_datum(u8, label=7)
    assert (datum.channels, datum.height, datum.width, datum.label) == (3, 4, 5, 7)
    np.testing.assert_array_equal(caffe_io.datum_to_array(datum), u8)
    floats = caffe_io.array_to_datum(u8 / 3.0)
    assert not floats.HasField('label') and len(floats.float_data) == 60
    back = caffe_io.datum_to_array(floats)
    assert back.dtype == np.float64
    np.testing.assert_allclose(back, (u8 / 3.0).astype(np.float32))
    with pytest.raises(ValueError):
        caffe_io.array_to_datum(np.zeros((4, 5)))

    arr, diff = np.random.RandomState(6).rand(2, 3, 4), np.random.RandomState(7).rand(2, 3, 4)
    blob = caffe_io.array_to_blobproto(arr, diff)
    assert list(blob.shape.dim) == [2, 3, 4] and len(blob.data) == 24 and not len(blob.double_data)
    np.testing.assert_allclose(caffe_io.blobproto_to_array(blob), arr.astype(np.float32))
    np.testing.assert_allclose(caffe_io.blobproto_to_array(blob, return_diff=True), diff.astype(np.float32))
    legacy = caffe_pb2.BlobProto(num=1, channels=2, height=1, width=3, data=range(6))
    assert caffe_io.blobproto_to_array(legacy).shape == (1, 2, 1, 3)
    assert caffe_io.blobproto_to_array(caffe_pb2.BlobProto(data=[4.0])) == 4.0
    with pytest.raises(ValueError):
        caffe_io.blobproto_to_array(caffe_pb2.BlobProto(data=[1.0, 2.0]))
    arrays = [np.arange(3.0), np.ones((2, 2))]
    restored = caffe_io.blobprotovector_str_to_arraylist(caffe_io.arraylist_to_blobprotovector_str(arrays))
    for a, b in zip(arrays, restored):
        np.testing.assert_array_equal(a, b)
    assert caffe.io.Transformer is caffe_io.Transformer          # also as caffe_syncbn.io


# ---- Net, Blob, Layer -------------------------------------------------------------------------
def test_forward_all_pads_the_last_batch(tmp_path):
    net = ip_net(tmp_path)
    x = np.random.RandomState(8).randn(10, 3, 2, 2).astype(np.float32)
    out = net.forward_all(data=x, blobs=['ip'])
    assert out['prob'].shape == (10, 5) and out['ip'].shape == (10, 5)
    assert net.blobs['data'].shape[0] == 4
    w, b = net.params['ip'][0].data, net.params['ip'][1].data
    np.testing.assert_allclose(out['ip'], x.reshape(10, -1) @ w.T + b, rtol=1e-5, atol=1e-5)

    top_diff = np.random.RandomState(9).randn(10, 5)
    outs, diffs = net.forward_backward_all(data=x, prob=top_diff)
    np.testing.assert_allclose(outs['prob'], out['prob'], atol=1e-6)
    assert diffs['data'].shape == (10, 3, 2, 2)
    for start in (0, 4, 8):          # the last batch holds 2 rows and 2 of padding
        rows = slice(start, min(start + 4, 10))
        batch = np.zeros((4, 3, 2, 2), np.float32)
        batch[:rows.stop - start] = x[rows]
        grad = np.zeros((4, 5))
        grad[:rows.stop - start] = top_diff[rows]
        net.forward(data=batch)
        np.testing.assert_allclose(diffs['data'][rows], net.backward(prob=grad)['data'][:rows.stop - start],
                                   atol=1e-6)
    with pytest.raises(CaffeError, match='differ in length'):
        net.forward_backward_all(data=x, prob=np.ones((9, 5)))


def test_share_with_shares_data_not_diff(tmp_path):
    a, b = ip_net(tmp_path), ip_net(tmp_path)
    b.share_with(a)
    a.params['ip'][0].data[...] = 3
    assert (b.params['ip'][0].data == 3).all()
    a.params['ip'][0].diff[...] = 1
    assert not b.params['ip'][0].diff.any()
    other = ip_net(tmp_path, IP_NET.replace('num_output: 5', 'num_output: 6'))
    with pytest.raises(CaffeError, match="layer 'ip' param 0 has shape"):
        other.share_with(a)


def test_blob_legacy_accessors_and_net_names(tmp_path):
    net = ip_net(tmp_path)
    data, ip = net.blobs['data'], net.blobs['ip']
    assert (data.num, data.channels, data.height, data.width) == (4, 3, 2, 2)
    assert (ip.num, ip.channels, ip.height, ip.width) == (4, 5, 1, 1)
    assert net.top_names['ip'] == ['ip'] and net.bottom_names['prob'] == ['ip']
    assert list(net.blob_loss_weights) == net._blob_names == ['data', 'ip', 'prob']
    with pytest.raises(CaffeError, match='5 axes'):
        caffe.Blob((1, 1, 1, 1, 2)).num


def test_set_mode_gpu_without_cupy_is_one_error(monkeypatch):
    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == 'cupy' or name.startswith('cupy.'):
            raise ImportError('No module named cupy')
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, 'cupy', raising=False)
    monkeypatch.setattr(builtins, '__import__', no_cupy)
    with pytest.raises(CaffeError, match='needs CuPy'):
        caffe.set_mode_gpu()
    from caffe_syncbn.backend import mode
    assert mode() == 'cpu'


# ---- NetSpec and coord_map ----------------------------------------------------------------------
def test_netspec_errors_and_topless_layers():
    data = L.DummyData(ntop=2)
    with pytest.raises(TypeError, match=r"^Silence input 0 is not a Top \(type is <class 'tuple'>\)$"):
        L.Silence(data, ntop=0)
    n = NetSpec()
    n.data, n.data2 = L.DummyData(shape=dict(dim=[3]), ntop=2)
    n.silence = L.Silence(n.data, n.data2, ntop=0)
    layers = n.to_proto().layer
    assert [layer.name for layer in layers] == ['data', 'silence'] and not layers[1].top
    for error in (KeyError, AttributeError):
        with pytest.raises(error):
            n.missing
    assert not hasattr(n, 'missing')
    with pytest.raises(AttributeError):
        L.Convolution(n.data, no_such_option=1).to_proto()


def conv_pool_deconv(ks=3, stride=1, pad=0, pool=2, dstride=2, dpad=0):
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 1, 100, 100]))
    n.conv = L.Convolution(n.data, num_output=10, kernel_size=ks, stride=stride, pad=pad)
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=pool, stride=pool, pad=0)
    n.deconv = L.Deconvolution(n.pool, num_output=10, kernel_size=dstride * 2, stride=dstride, pad=dpad)
    return n


def test_coord_map_rules():
    n = conv_pool_deconv()
    ax, a, b = coord_map.coord_map_from_to(n.deconv, n.data)
    assert ax == 1 and a == 1 and b == 0     # 2x pooling undone by 2x upsampling: the identity
    n4 = conv_pool_deconv(pool=4, dstride=4)
    assert coord_map.coord_map_from_to(n4.deconv, n4.data)[2] == -1
    n.relu = L.ReLU(n.deconv)
    n.conv1x1 = L.Convolution(n.relu, num_output=10, kernel_size=1)
    assert coord_map.coord_map_from_to(n.conv1x1, n.data) == (ax, a, b)
    for pad in (3, 7):            # conv padding shifts one way, deconv padding the other
        m = conv_pool_deconv(pad=pad)
        assert coord_map.coord_map_from_to(m.deconv, m.data)[2] == b - pad
        m = conv_pool_deconv(dpad=pad)
        assert coord_map.coord_map_from_to(m.deconv, m.data)[2] == b + pad
    m = conv_pool_deconv(pad=5)
    m.crop = coord_map.crop(m.deconv, m.data)
    layer = [lp for lp in m.to_proto().layer if lp.type == 'Crop'][0]
    assert (layer.crop_param.axis, list(layer.crop_param.offset)) == (2, [5])
    n.ip = L.InnerProduct(n.deconv, num_output=10)
    with pytest.raises(RuntimeError):
        coord_map.coord_map_from_to(n.ip, n.data)
    for m in (conv_pool_deconv(pool=3),     # 3x pooling, 2x upsampling
              conv_pool_deconv(dpad=10)):   # output smaller than the input
        with pytest.raises(AssertionError):
            coord_map.crop(m.deconv, m.data)
