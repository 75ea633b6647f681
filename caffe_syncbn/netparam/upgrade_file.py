"""``caffe-syncbn upgrade``: a copy of an old net prototxt, binary caffemodel or solver
prototxt in the current format, as Caffe's upgrade_net_proto_text,
upgrade_net_proto_binary and upgrade_solver_proto_text write it."""
import logging

from google.protobuf import text_format

from .. import caffe_pb2
from ..errors import CaffeError
from ..formats.atomic import atomic_write
from ..formats.blobs import HDF5_MAGIC, parse_binary_file
from ..formats.regular import require_regular
from .prototxt import read_prototxt
from .solver_param import copy_message, upgrade_solver_param
from .upgrade import upgrade_net_param

log = logging.getLogger('caffe_syncbn')


def upgrade_file(source, target, check_solver_type):
    """Write ``source`` (a net prototxt, a binary caffemodel or a solver prototxt) to
    ``target`` in the current format, atomically, in the form it came in (text or binary).
    Returns what the file is: 'net prototxt', 'binary net' or 'solver prototxt'.
    ``check_solver_type(type, source)`` raises for a solver type that no update rule
    registered (the training room knows them, this floor does not)."""
    with open(require_regular(source), 'rb') as f:
        head = f.read(1 << 16)
    if not head:
        raise CaffeError('%s is empty' % source)
    if head.startswith(HDF5_MAGIC):
        raise CaffeError('%s is an HDF5 caffemodel; HDF5 weights were never written in an old '
                         'format, so there is nothing to upgrade' % source)
    if _is_text(head):
        kind, original = _read_text_net_or_solver(source)
    else:
        kind, original = 'binary net', parse_binary_file(source, caffe_pb2.NetParameter)
    if kind == 'solver prototxt':
        upgraded = upgrade_solver_param(copy_message(original), source)
        check_solver_type(upgraded.type, source)
    else:
        upgraded = upgrade_net_param(original)
    if upgraded == original:
        log.info('%s is already in the current format; writing it unchanged', source)
    with atomic_write(target) as f:
        if kind == 'binary net':
            f.write(upgraded.SerializeToString())
        else:
            f.write(text_format.MessageToString(upgraded).encode('utf-8'))
    log.info('Wrote the upgraded %s to %s', kind, target)
    return kind


def _is_text(head):
    """Prototxt is UTF-8 without NUL bytes; a binary protobuf has both (tags, zeros)."""
    if b'\0' in head:
        return False
    try:
        head.decode('utf-8')
    except UnicodeDecodeError as exc:   # valid up to a character cut at the end of the head
        return exc.start >= len(head) - 3
    return True


def _read_text_net_or_solver(path):
    """('net prototxt' or 'solver prototxt', message): a file that is neither gets the
    parse error of the kind it looks more like."""
    attempts = [('net prototxt', caffe_pb2.NetParameter), ('solver prototxt', caffe_pb2.SolverParameter)]
    errors = []
    for kind, message_class in attempts:
        try:
            return kind, read_prototxt(path, message_class())
        except CaffeError as exc:
            errors.append(exc)
    with open(path, encoding='utf-8', errors='replace') as f:
        looks_like_solver = any(word in f.read() for word in ('base_lr', 'max_iter', 'lr_policy'))
    raise errors[1 if looks_like_solver else 0]
