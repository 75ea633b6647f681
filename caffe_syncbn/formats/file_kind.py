"""What a file given in the wrong place is, so that its error says so: a weights reader
handed a text prototxt or a solver state, the solver state reader handed a caffemodel.

Binary caffemodels and solver states are both bare protobuf messages, told apart by
their top-level fields: a NetParameter's field 1 is its name (length-delimited) and its
layers are field 100 (or 2, V1); a SolverState's field 1 is ``iter``, a varint, which
Caffe always writes. A prototxt is text: UTF-8 without control characters.
"""
import mmap
import os

from google.protobuf import text_format

from .. import caffe_pb2
from ..errors import CaffeError
from .blobs import HDF5_MAGIC
from .regular import not_regular
from .wire import read_varint

CAFFEMODEL = 'a caffemodel (weights)'
SOLVER_STATE = 'a solver state'
NET_PROTOTXT = 'a text prototxt (a net definition)'
SOLVER_PROTOTXT = 'a text prototxt (a solver definition)'
TEXT = 'a text file'

#: the bytes read to decide whether a file is text
_HEAD = 1 << 16
#: prototxts are small: a larger text file is not parsed to say which one it is
_MAX_PROTOTXT = 8 << 20
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_NET_LAYER = caffe_pb2.NetParameter.DESCRIPTOR.fields_by_name['layer'].number
_STATE_ITER = caffe_pb2.SolverState.DESCRIPTOR.fields_by_name['iter'].number


def binary_kind(path):
    """CAFFEMODEL, SOLVER_STATE, one of the text kinds, or None (HDF5, another kind of
    file, a damaged one, or one that cannot be read: its reader says more)."""
    if not_regular(path):
        return None
    try:
        with open(path, 'rb') as f:
            if os.fstat(f.fileno()).st_size == 0:
                return None
            head = f.read(_HEAD)
            if head.startswith(HDF5_MAGIC):
                return None
            if _is_text(head, len(head) < _HEAD):
                return _text_kind(f)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                return _message_kind(mapped)
    except (OSError, ValueError):
        return None


def hdf5_kind(f):
    """CAFFEMODEL, SOLVER_STATE or None for an open h5py File, by the names Caffe gives
    its top-level entries."""
    if 'iter' in f and 'history' in f:
        return SOLVER_STATE
    return CAFFEMODEL if 'data' in f else None


def wrong_kind(path, kind, expected):
    """The error for ``path``, of ``kind``, given where ``expected`` ('weights' or 'a
    solver state') was wanted; None where ``kind`` is what was wanted, or unknown."""
    if expected == 'weights' and kind == SOLVER_STATE:
        return CaffeError('%s is a solver state, not weights (use train -snapshot to resume from '
                          'it; solver.restore in Python)' % path)
    if expected == 'a solver state' and kind == CAFFEMODEL:
        return CaffeError('%s is a caffemodel (weights), not a solver state (use -weights to '
                          'start from it; net.copy_from in Python)' % path)
    if kind in (NET_PROTOTXT, SOLVER_PROTOTXT, TEXT):
        wanted = ('a binary .caffemodel or a .caffemodel.h5' if expected == 'weights' else
                  'a .solverstate or a .solverstate.h5')
        return CaffeError('%s is %s, not %s (%s)' % (path, kind, expected, wanted))
    return None


def _is_text(head, whole):
    """Whether ``head``, the start of a file (``whole``: all of it), is UTF-8 text."""
    try:
        text = head.decode('utf-8')
    except UnicodeDecodeError as exc:
        if whole or exc.start < len(head) - 3 or exc.reason != 'unexpected end of data':
            return False
        text = head[:exc.start].decode('utf-8')      # a character cut by the end of the head
    return bool(text.strip()) and all(c >= ' ' or c in '\t\n\r\f\v' for c in text)


def _text_kind(f):
    f.seek(0)
    raw = f.read(_MAX_PROTOTXT + 1)
    if len(raw) > _MAX_PROTOTXT:
        return TEXT
    text = raw.decode('utf-8', 'replace')
    for message, kind in ((caffe_pb2.NetParameter(), NET_PROTOTXT),
                          (caffe_pb2.SolverParameter(), SOLVER_PROTOTXT)):
        try:
            text_format.Parse(text, message)
            return kind
        except text_format.ParseError:
            continue
    return TEXT


def _message_kind(view):
    """A binary message's kind by its top-level fields; None unless they make up the
    whole file."""
    fields, position, end = set(), 0, len(view)
    while position < end:
        key, position = read_varint(view, position, end)
        if key is None:
            return None
        wire_type = key & 7
        if wire_type == _VARINT:
            _, position = read_varint(view, position, end)
        elif wire_type in (_FIXED64, _FIXED32):
            position += 8 if wire_type == _FIXED64 else 4
        elif wire_type == _LENGTH:
            length, position = read_varint(view, position, end)
            position = None if length is None else position + length
        else:
            return None
        if position is None or position > end:
            return None
        fields.add((key >> 3, wire_type))
    if (_NET_LAYER, _LENGTH) in fields or (1, _LENGTH) in fields:
        return CAFFEMODEL
    if (_STATE_ITER, _VARINT) in fields:
        return SOLVER_STATE
    return None
