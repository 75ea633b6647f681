"""Bad nets and bad weight files give a CaffeError that says where and what, never a crash."""
import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.formats.blobs import array_to_blob

NET = '''name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 12 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: %d bias_term: %s } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
'''


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
    return str(path)


@pytest.fixture
def saved(tmp_path):
    """(prototxt path, caffemodel path, caffemodel bytes) of a net with 50x12 + 50 weights."""
    model = write(tmp_path, 'net.prototxt', NET % (50, 'true'))
    weights = str(tmp_path / 'net.caffemodel')
    caffe.Net(model, caffe.TEST).save(weights)
    with open(weights, 'rb') as f:
        return model, weights, f.read()


@pytest.mark.parametrize('text, line, column, what', [
    ('name: "x"\nlayer {\n  name: "data"\n  input_param { shape { dim: 1 dim: x } }\n}\n', 4, 37, 'x'),
    ('name: "x"\nlayer {\n  name: "data"\n  typo: "Input"\n}\n', 4, 3, 'typo'),
    ('name: "x"\nlayer {\n  name: "data"\n', 3, 0, '}'),
])
def test_malformed_prototxt_names_file_line_and_column(tmp_path, text, line, column, what):
    path = write(tmp_path, 'broken.prototxt', text)
    with pytest.raises(CaffeError) as info:
        caffe.Net(path, caffe.TEST)
    message = str(info.value)
    assert message.startswith('%s:%d:' % (path, line)) and what in message
    if column:
        assert message.startswith('%s:%d:%d:' % (path, line, column))


@pytest.mark.parametrize('typo, suggestion', [('Convolutoin', 'Convolution'),
                                              ('InnerProdcut', 'InnerProduct'),
                                              ('Relu', 'ReLU'), ('SoftmaxWithLos', 'SoftmaxWithLoss')])
def test_unknown_layer_type_names_the_closest_types(tmp_path, typo, suggestion):
    text = (NET % (5, 'true')).replace('type: "ReLU"', 'type: "%s"' % typo)
    with pytest.raises(CaffeError) as info:
        caffe.Net(write(tmp_path, 'net.prototxt', text), caffe.TEST)
    message = str(info.value)
    assert "'relu1'" in message and typo in message and "'%s'" % suggestion in message


def test_missing_bottom_names_the_layer(tmp_path):
    text = NET % (5, 'true') + 'layer { name: "loss" type: "EuclideanLoss" bottom: "ip1" bottom: "target" }'
    with pytest.raises(CaffeError, match="layer 'loss'.*'target'"):
        caffe.Net(write(tmp_path, 'net.prototxt', text), caffe.TRAIN)


def test_duplicate_top_producer_names_the_layer_and_blob(tmp_path):
    text = NET % (5, 'true') + 'layer { name: "again" type: "TanH" bottom: "data" top: "ip1" }'
    with pytest.raises(CaffeError, match="layer 'again'.*'ip1'.*more than one"):
        caffe.Net(write(tmp_path, 'net.prototxt', text), caffe.TEST)


def corruptions(data):
    rs = np.random.RandomState(0)
    return {
        'half': data[:len(data) // 2],
        'last_byte_missing': data[:-1],
        'ten_bytes': data[:10],
        'garbage': rs.randint(0, 256, 1000).astype(np.uint8).tobytes(),
        'overwritten': data[:20] + b'\xff' * 50 + data[70:],
        'empty': b'',
    }


@pytest.mark.parametrize('kind', sorted(corruptions(b'0' * 100)))
def test_truncated_or_corrupt_caffemodel_names_the_file(tmp_path, saved, kind):
    model, _, data = saved
    path = write(tmp_path, kind + '.caffemodel', corruptions(data)[kind])
    with pytest.raises(CaffeError, match=kind + r'\.caffemodel'):
        caffe.Net(model, caffe.TEST, weights=path)


def test_other_unreadable_weights(tmp_path, saved):
    model, _, _ = saved
    with pytest.raises(CaffeError, match='nothere.caffemodel'):
        caffe.Net(model, caffe.TEST, weights=str(tmp_path / 'nothere.caffemodel'))
    with pytest.raises(CaffeError, match='net.prototxt'):     # a prototxt given as weights
        caffe.Net(model, caffe.TEST, weights=model)
    net = caffe.Net(model, caffe.TEST)
    net.save_hdf5(str(tmp_path / 'net.caffemodel.h5'))
    data = (tmp_path / 'net.caffemodel.h5').read_bytes()
    for name, broken in (('half.h5', data[:len(data) // 2]), ('header.h5', data[:8] + b'x' * 100)):
        with pytest.raises(CaffeError, match=name):
            net.copy_from(write(tmp_path, name, broken))
    bad = caffe_pb2.NetParameter()
    layer = bad.layer.add(name='ip1', type='InnerProduct')
    array_to_blob(np.zeros(10, np.float32), layer.blobs.add())
    layer.blobs[0].shape.dim[:] = [50, 12]                       # 600 values announced, 10 stored
    array_to_blob(np.zeros(50, np.float32), layer.blobs.add())
    path = write(tmp_path, 'counts.caffemodel', bad.SerializeToString())
    with pytest.raises(CaffeError, match=r"counts\.caffemodel.*'ip1'.*\b10\b.*\b600\b"):
        net.copy_from(path)


@pytest.mark.parametrize('fmt', ['binary', 'hdf5'])
def test_weights_that_do_not_fit_name_layer_index_and_shapes(tmp_path, saved, fmt):
    model, weights, _ = saved
    if fmt == 'hdf5':
        weights = str(tmp_path / 'net.caffemodel.h5')
        caffe.Net(model, caffe.TEST).save_hdf5(weights)
    smaller = write(tmp_path, 'smaller.prototxt', NET % (40, 'true'))
    with pytest.raises(CaffeError) as info:
        caffe.Net(smaller, caffe.TEST, weights=weights)
    message = str(info.value)
    assert "'ip1'" in message and 'blob 0' in message and weights in message
    assert '[50, 12]' in message and '[40, 12]' in message
    no_bias = write(tmp_path, 'no_bias.prototxt', NET % (50, 'false'))
    with pytest.raises(CaffeError, match="'ip1'.*2 blob.*1"):
        caffe.Net(no_bias, caffe.TEST, weights=weights)
