"""Blobs on disk: BlobProto <-> numpy, binary protobuf files, .binaryproto.

Blob payloads are converted to and from numpy in bulk (raw little-endian bytes), never
element by element. Binary files are memory-mapped and parsed in one call, with no
protobuf size limit, so VGG-sized (500+ MB) models load.
"""
import mmap
import os

import numpy as np
from google.protobuf.message import DecodeError

from .. import caffe_pb2
from ..backend import to_numpy
from ..blob import format_bytes, memory_limit
from ..errors import CaffeError, quote
from .atomic import atomic_write
from .regular import not_regular, require_regular
from .wire import check_record_count

HDF5_MAGIC = b'\x89HDF\r\n\x1a\n'
_BLOB_DATA_FIELD = caffe_pb2.BlobProto.DESCRIPTOR.fields_by_name['data'].number
_BLOB_DOUBLE_FIELD = caffe_pb2.BlobProto.DESCRIPTOR.fields_by_name['double_data'].number
ARENA_FULL = 'Arena alloc failed'


# ---- blobs ------------------------------------------------------------------------------
def is_legacy(proto):
    return any(proto.HasField(f) for f in ('num', 'channels', 'height', 'width'))


def blob_shape(proto):
    """The shape a BlobProto describes: ``shape`` or the legacy 4-D num/channels/height/width."""
    if is_legacy(proto):
        return (proto.num, proto.channels, proto.height, proto.width)
    return tuple(int(d) for d in proto.shape.dim)


#: the numpy type of each float type of NVCaffe's raw blobs (BlobProto.RawType)
RAW_DTYPES = {caffe_pb2.BlobProto.DOUBLE: '<f8', caffe_pb2.BlobProto.FLOAT: '<f4',
              caffe_pb2.BlobProto.FLOAT16: '<f2'}


def _raw_values(proto, diff):
    """The values of NVCaffe's raw bytes of a BlobProto's data (or diff): float64 from
    DOUBLE, float32 from FLOAT and FLOAT16 (which float32 holds exactly)."""
    field = 'raw_diff' if diff else 'raw_data'
    kind = field + '_type'
    if not proto.HasField(kind):
        raise CaffeError('blob holds NVCaffe %s without its %s' % (field, kind))
    dtype = RAW_DTYPES.get(getattr(proto, kind))
    if dtype is None:
        raise CaffeError('blob holds NVCaffe %s of type %s; weights are DOUBLE, FLOAT or '
                         'FLOAT16' % (field, proto.RawType.Name(getattr(proto, kind))))
    raw = getattr(proto, field)
    if len(raw) % np.dtype(dtype).itemsize:
        raise CaffeError('blob holds %d bytes of NVCaffe %s, not a whole number of %s '
                         'values' % (len(raw), field, proto.RawType.Name(getattr(proto, kind))))
    values = np.frombuffer(raw, dtype)
    return values.astype(np.float64 if values.dtype.itemsize == 8 else np.float32)


def blob_to_array(proto, diff=False):
    """A numpy array (float32, or float64 for ``double_data``) holding a BlobProto's data:
    Caffe's packed floats or doubles, or else NVCaffe's raw bytes (``raw_data``).

    Legacy blobs keep their 4-D num/channels/height/width shape, as in pycaffe.
    """
    shape = blob_shape(proto)
    singles, doubles = (proto.diff, proto.double_diff) if diff else (proto.data, proto.double_data)
    if len(doubles):
        values = np.array(doubles, np.float64)
    elif len(singles) or not proto.HasField('raw_diff' if diff else 'raw_data'):
        values = np.array(singles, np.float32)
    else:
        values = _raw_values(proto, diff)
    count = int(np.prod(shape, dtype=np.int64))
    if values.size != count:
        raise CaffeError('blob of shape %s holds %d values, expected %d'
                         % (list(shape), values.size, count))
    return values.reshape(shape)


def _varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def length_delimited(field, payload):
    """Wire bytes of field ``field`` holding ``payload`` (packed numbers or a sub-message)."""
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def array_to_blob(array, proto=None):
    """A BlobProto (modern ``shape`` form) holding ``array``: float64 as ``double_data``,
    anything else as float32 ``data``. Fills ``proto`` when given."""
    array = to_numpy(array)
    proto = caffe_pb2.BlobProto() if proto is None else proto
    proto.Clear()
    if array.ndim:      # Caffe leaves `shape` unset for a 0-d blob
        proto.shape.dim.extend(array.shape)
    if array.dtype == np.float64:
        field, raw = _BLOB_DOUBLE_FIELD, array.astype('<f8').tobytes()
    else:
        field, raw = _BLOB_DATA_FIELD, array.astype('<f4').tobytes()
    if raw:
        # Parsing the packed bytes is a bulk copy; extend() would box every value.
        proto.MergeFromString(length_delimited(field, raw))
    return proto


def read_blob_proto(path):
    """The array stored in a .binaryproto BlobProto file (mean file, infogain matrix)."""
    proto = parse_binary_file(path, caffe_pb2.BlobProto)
    try:
        return blob_to_array(proto)
    except CaffeError as exc:
        raise CaffeError('%s: %s' % (path, exc)) from None


def write_blob_proto(path, array):
    with atomic_write(path) as f:
        f.write(array_to_blob(array).SerializeToString())


# ---- files ------------------------------------------------------------------------------
def is_hdf5(path):
    path = os.fspath(path)
    if path.endswith('.h5'):
        return True
    if not_regular(path):       # opening a FIFO to look would wait for a writer
        return False
    try:
        with open(path, 'rb') as f:
            return f.read(len(HDF5_MAGIC)) == HDF5_MAGIC
    except OSError:
        return False


def parse_binary_file(path, message_class):
    path = os.fspath(path)
    what = message_class.DESCRIPTOR.name
    require_regular(path)
    try:
        with open(path, 'rb') as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise CaffeError('%s: the file is empty, not a binary %s' % (path, what))
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                if mapped[:len(HDF5_MAGIC)] == HDF5_MAGIC:
                    raise CaffeError('%s is an HDF5 file, not a binary %s' % (path, what))
                with memoryview(mapped) as view:
                    check_record_count(view, message_class.DESCRIPTOR, path)
                    return message_class.FromString(view)
    except OSError as exc:
        raise CaffeError('cannot read %s: %s' % (quote(path), exc.strerror or exc)) from None
    except MemoryError:
        raise out_of_memory(path) from None
    except DecodeError as exc:
        if ARENA_FULL in str(exc):      # how the parser says that an allocation failed
            raise out_of_memory(path) from None
        raise CaffeError('%s is not a valid binary %s: the file is truncated or corrupt'
                         % (path, what)) from None


def out_of_memory(path):
    return CaffeError('ran out of memory reading %s (the memory limit is %s)'
                      % (path, format_bytes(memory_limit())))
