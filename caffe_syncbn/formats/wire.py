"""A bound on the records of a binary protobuf file, checked before it is parsed.

A record (a sub-message: a layer, a blob, a param spec) costs a few hundred bytes in
memory however small it is on disk: an empty layer takes 3 bytes of the file and about
600 bytes once parsed, so a 30 MB file of empty layers asks for gigabytes. The walk
below counts the records in the protobuf wire format without building them, and refuses
a file with more than ``max_records()`` of them; a net's weights hold a few thousand.
The walk only counts: where the bytes do not make sense it stops, and the parser that
follows says what is wrong with them.
"""
import collections
import os

from ..errors import CaffeError

#: the default: about 20 times the records of a 1000-layer net's weights, and at most
#: about 150 MB of memory however the records are spent
DEFAULT_MAX_RECORDS = 200000
MAX_RECORDS_VARIABLE = 'CAFFE_SYNCBN_MAX_RECORDS'

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def max_records():
    """The bound on records: CAFFE_SYNCBN_MAX_RECORDS where set, else the default."""
    text = os.environ.get(MAX_RECORDS_VARIABLE, '')
    try:
        value = int(text) if text else DEFAULT_MAX_RECORDS
    except ValueError:
        raise CaffeError('%s=%s is not a number of records'
                         % (MAX_RECORDS_VARIABLE, text)) from None
    if value < 1:
        raise CaffeError('%s=%s: the bound must be at least 1' % (MAX_RECORDS_VARIABLE, text))
    return value


def check_record_count(view, descriptor, path):
    """Refuse the serialized ``descriptor`` message in ``view`` (bytes or a memoryview)
    if it holds more than ``max_records()`` sub-messages, with an error naming the file,
    the bound and the field that holds the most."""
    limit = max_records()
    counts = collections.Counter()
    total = 0
    pending = [(0, len(view), descriptor)]
    while pending:
        position, end, message = pending.pop()
        while position < end:
            key, position = read_varint(view, position, end)
            if key is None:
                return
            wire_type = key & 7
            if wire_type == _VARINT:
                _, position = read_varint(view, position, end)
                if position is None:
                    return
            elif wire_type == _FIXED64:
                position += 8
            elif wire_type == _FIXED32:
                position += 4
            elif wire_type == _LENGTH:
                length, position = read_varint(view, position, end)
                if length is None or position + length > end:
                    return
                field = message.fields_by_number.get(key >> 3)
                if field is not None and field.message_type is not None:
                    counts[field.name] += 1
                    total += 1
                    if total > limit:
                        raise _too_many(path, limit, counts, position, len(view))
                    pending.append((position, position + length, field.message_type))
                position += length
            else:                      # groups: no Caffe message has one
                return


def read_varint(view, position, end):
    """(value, next position), or (None, None) where the varint runs past ``end``."""
    value, shift = 0, 0
    while position < end and shift < 70:
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7
    return None, None


def _too_many(path, limit, counts, position, size):
    field, count = counts.most_common(1)[0]
    return CaffeError("%s holds more than %d records (%d '%s' records in its first %d of %d "
                      "bytes), far more than Caffe's files hold; %s raises the bound"
                      % (path, limit, count, field, position, size, MAX_RECORDS_VARIABLE))
