"""A binary .caffemodel read layer by layer from its memory map.

Every blob's packed float ``data`` stays in the file (a MappedBlob) until it is copied
into a net, a chunk at a time, and the pages each chunk was read from are then given back.
So loading holds the net's weights and one chunk of the file, where parsing the whole
file holds the mapped file, its parsed copy and the net's weights at once: three times
the weights, most of the peak of scoring a VGG-sized net. The layer records, with those
floats cut out, are parsed in one call; a blob whose data is not one packed field
(doubles, or floats written unpacked) is parsed whole with them.
"""
import collections
import mmap
import os

import numpy as np
from google.protobuf.message import DecodeError

from .. import caffe_pb2
from ..backend import get_array_module
from ..errors import CaffeError
from .blobs import ARENA_FULL, blob_shape, length_delimited, out_of_memory
from .regular import require_regular
from .wire import check_record_count, read_varint

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_NET_LAYER = caffe_pb2.NetParameter.DESCRIPTOR.fields_by_name['layer'].number
_NET_V1_LAYER = caffe_pb2.NetParameter.DESCRIPTOR.fields_by_name['layers'].number
_LAYER_BLOBS = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name['blobs'].number
_V1_LAYER_BLOBS = caffe_pb2.V1LayerParameter.DESCRIPTOR.fields_by_name['blobs'].number
_BLOB_DATA = caffe_pb2.BlobProto.DESCRIPTOR.fields_by_name['data'].number
#: values copied between two page releases (64 MiB of float32)
CHUNK = 16 << 20


class _Corrupt(Exception):
    pass


class MappedBlob:
    """A BlobProto whose float data is ``count`` values at byte ``offset`` of ``mapped``;
    ``proto`` holds its other fields (the shape), and is the one in its layer's record."""

    def __init__(self, proto, mapped, offset, count):
        self.proto, self.mapped, self.offset, self.count = proto, mapped, offset, count

    def values(self):
        """The data as a read-only array of the blob's shape, viewing the file."""
        shape = blob_shape(self.proto)
        expected = int(np.prod(shape, dtype=np.int64))
        if self.count != expected:
            raise CaffeError('blob of shape %s holds %d values, expected %d'
                             % (list(shape), self.count, expected))
        return np.frombuffer(self.mapped, '<f4', self.count, self.offset).reshape(shape)

    def copy_into(self, target):
        """target[...] = the data, a chunk at a time, giving each chunk's pages back."""
        xp = get_array_module(target)
        source = self.values()
        if not target.flags.c_contiguous:          # no flat view to fill: all at once
            target[...] = xp.asarray(source.reshape(target.shape), dtype=target.dtype)
            return
        source, flat = source.reshape(-1), target.reshape(-1)
        for start in range(0, self.count, CHUNK):
            end = min(start + CHUNK, self.count)
            flat[start:end] = xp.asarray(source[start:end], dtype=flat.dtype)
            self._release(self.offset + 4 * start, self.offset + 4 * end)

    def _release(self, begin, end):
        page = mmap.PAGESIZE
        begin, end = -(-begin // page) * page, end // page * page
        if end > begin:
            self.mapped.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def read_mapped_weights(path):
    """({layer name: [MappedBlob or BlobProto]}, the V2 LayerParameters (whose mapped blobs
    hold their shapes only), or None for a V1 file) of the binary .caffemodel at ``path``."""
    require_regular(path)
    what = 'binary NetParameter'
    try:
        with open(path, 'rb') as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise CaffeError('%s: the file is empty, not a %s' % (path, what))
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        view = memoryview(mapped)
        check_record_count(view, caffe_pb2.NetParameter.DESCRIPTOR, path)
        return _layers(view, mapped)
    except OSError as exc:
        raise CaffeError('cannot read %s: %s' % (path, exc.strerror or exc)) from None
    except MemoryError:
        raise out_of_memory(path) from None
    except (_Corrupt, DecodeError) as exc:
        if ARENA_FULL in str(exc):           # how the parser says that an allocation failed
            raise out_of_memory(path) from None
        raise CaffeError('%s is not a valid %s: the file is truncated or corrupt'
                         % (path, what)) from None


def _layers(view, mapped):
    """Every layer record with its blobs' packed floats cut out, parsed in one call (as
    the whole file was, so that a file of millions of records runs out of memory with
    the parser's error), and the blobs whose floats stay in the file made MappedBlobs."""
    stripped, places = bytearray(), {_NET_LAYER: [], _NET_V1_LAYER: []}
    for number, wire_type, begin, end, _ in _fields(view, 0, len(view)):
        if number in places and wire_type == _LENGTH:
            layer, where = _strip_layer(view, begin, end, number == _NET_LAYER)
            stripped += length_delimited(number, layer)
            places[number].append(where)
    param = caffe_pb2.NetParameter.FromString(bytes(stripped))
    blobs = collections.OrderedDict()
    for layers, where in ((param.layer, places[_NET_LAYER]), (param.layers, places[_NET_V1_LAYER])):
        for layer, layer_places in zip(layers, where):      # V2 layers first, as Caffe
            blobs[layer.name] = [blob if place is None else MappedBlob(blob, mapped, *place)
                                 for blob, place in zip(layer.blobs, layer_places)]
    return blobs, list(param.layer) or None


def _strip_layer(view, begin, end, v2):
    """A layer record's bytes with its blobs' packed floats cut out, and per blob where
    they are in the file ((offset, count), or None for a blob kept whole)."""
    blob_field = _LAYER_BLOBS if v2 else _V1_LAYER_BLOBS
    out, places = bytearray(), []
    for number, wire_type, start, stop, field_start in _fields(view, begin, end):
        if number == blob_field and wire_type == _LENGTH:
            blob, place = _strip_blob(view, start, stop)
            out += length_delimited(blob_field, blob)
            places.append(place)
        else:
            out += view[field_start:stop]
    return bytes(out), places


def _strip_blob(view, begin, end):
    rest, data = bytearray(), []
    for number, wire_type, start, stop, field_start in _fields(view, begin, end):
        if number == _BLOB_DATA:
            data.append((wire_type, start, stop))
        else:
            rest += view[field_start:stop]
    if len(data) != 1 or data[0][0] != _LENGTH or (data[0][2] - data[0][1]) % 4:
        return bytes(view[begin:end]), None            # parsed whole
    _, start, stop = data[0]
    return bytes(rest), (start, (stop - start) // 4)


def _fields(view, begin, end):
    """(number, wire type, payload start, payload end, field start) of each field of the
    message in view[begin:end]."""
    position = begin
    while position < end:
        field_start = position
        key, position = read_varint(view, position, end)
        if key is None:
            raise _Corrupt()
        wire_type = key & 7
        if wire_type == _VARINT:
            _, stop = read_varint(view, position, end)
        elif wire_type in (_FIXED64, _FIXED32):
            stop = position + (8 if wire_type == _FIXED64 else 4)
        elif wire_type == _LENGTH:
            length, position = read_varint(view, position, end)
            stop = None if length is None else position + length
        else:
            raise _Corrupt()
        if stop is None or stop > end:
            raise _Corrupt()
        yield key >> 3, wire_type, position, stop, field_start
        position = stop
