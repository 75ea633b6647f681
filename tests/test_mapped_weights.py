"""A binary .caffemodel is read from its memory map, a layer at a time, and each blob's
packed floats go from the file into the net a chunk at a time (formats/mapped.py): the
weights are those a whole parse of the file gives, in V1 and V2 files, for blobs written
unpacked or as doubles too, whatever the chunk size; a cut file is one error."""
import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.formats import mapped
from caffe_syncbn.formats.blobs import length_delimited
from caffe_syncbn.formats.caffemodel import read_net_param
from helpers.net_helpers import MLP, build, randomize

_DATA = caffe_pb2.BlobProto.DESCRIPTOR.fields_by_name['data'].number
_LAYER_BLOBS = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name['blobs'].number
_NET_LAYER = caffe_pb2.NetParameter.DESCRIPTOR.fields_by_name['layer'].number


def saved(tmp_path, seed=0):
    net = build(MLP)
    randomize(net, seed)
    path = tmp_path / 'mlp.caffemodel'
    net.save(str(path))
    return net, path


def loaded(path):
    net = build(MLP)
    net.copy_from(str(path))
    return net


def same_weights(a, b):
    for x, y in zip(a.learnable_params, b.learnable_params):
        np.testing.assert_array_equal(x.data, y.data)


def test_weights_go_from_the_file_into_the_net_in_chunks_of_any_size(tmp_path, monkeypatch):
    net, path = saved(tmp_path)
    blobs, layers = mapped.read_mapped_weights(str(path))
    assert [layer.name for layer in layers] == [lp.name for lp in read_net_param(str(path)).layer]
    assert all(isinstance(item, mapped.MappedBlob) for items in blobs.values() for item in items)
    assert not any(len(blob.data) for layer in layers for blob in layer.blobs)   # in the file
    for chunk in (1, 3, 7, 1 << 20):
        monkeypatch.setattr(mapped, 'CHUNK', chunk)
        same_weights(net, loaded(path))


def rewrite(path, change):
    """The file with every blob's bytes given by ``change`` (a BlobProto -> bytes), written
    as they are: parsing and serializing again would pack them."""
    param = read_net_param(str(path))
    out = caffe_pb2.NetParameter(name=param.name).SerializeToString()
    for layer in param.layer:
        blobs = list(layer.blobs)
        layer.ClearField('blobs')
        raw = layer.SerializeToString() + b''.join(length_delimited(_LAYER_BLOBS, change(b))
                                                    for b in blobs)
        out += length_delimited(_NET_LAYER, raw)
    path.write_bytes(out)


def unpacked(blob):
    """The same floats, each as its own field: what a writer that ignores [packed] gives."""
    shape = caffe_pb2.BlobProto(shape=blob.shape).SerializeToString()
    return shape + b''.join(bytes([(_DATA << 3) | 5]) + np.float32(v).tobytes()
                            for v in blob.data)


def doubles(blob):
    out = caffe_pb2.BlobProto()
    out.shape.CopyFrom(blob.shape)
    out.double_data.extend(blob.data)
    return out.SerializeToString()


@pytest.mark.parametrize('change', [unpacked, doubles])
def test_blobs_not_in_one_packed_float_field_are_parsed_whole(tmp_path, change):
    net, path = saved(tmp_path)
    rewrite(path, change)
    blobs, _ = mapped.read_mapped_weights(str(path))
    assert not any(isinstance(item, mapped.MappedBlob) for items in blobs.values() for item in items)
    same_weights(net, loaded(path))


def test_a_v1_file_loads_as_its_parse_says(tmp_path):
    net, path = saved(tmp_path)
    param = read_net_param(str(path))
    v1 = caffe_pb2.NetParameter(name=param.name)
    for layer in param.layer:
        if layer.blobs:
            old = v1.layers.add(name=layer.name, type=caffe_pb2.V1LayerParameter.INNER_PRODUCT)
            old.blobs.extend(layer.blobs)
    path.write_bytes(v1.SerializeToString())
    blobs, layers = mapped.read_mapped_weights(str(path))
    assert layers is None and list(blobs) == ['ip1', 'ip2']
    same_weights(net, loaded(path))


@pytest.mark.parametrize('keep', [0.3, 0.7, 0.999])
def test_a_cut_file_is_one_error(tmp_path, keep):
    _, path = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(caffe.CaffeError, match='truncated or corrupt|holds .* values'):
        loaded(path)
