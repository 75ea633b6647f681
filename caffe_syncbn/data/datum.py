"""Caffe's Datum records and the LMDB databases that hold them.

A Datum is one sample: ``data`` holds uint8 pixels in C x H x W order (BGR for colour
images, as OpenCV reads them), or the bytes of a PNG/JPEG file when ``encoded`` is set;
``float_data`` replaces ``data`` for float input. Images go through OpenCV, as in Caffe,
so pixel values (JPEG decoding, resizing) match what Caffe's tools produce. An image
with more pixels than a bound is refused before it is decoded (see image_size.py).
"""
import math
import os
import shutil
import tempfile

import numpy as np
from google.protobuf.message import DecodeError

from .. import caffe_pb2
from ..errors import CaffeError, quote
from ..formats.regular import not_regular, require_regular
from .image_size import (DEFAULT_MAX_PIXELS, MAX_PIXELS_VARIABLE, check_image_size,
                         max_image_pixels)
from .lmdbfile import LMDBFile


def cv2():
    """OpenCV, imported on first use: only image files and encoded records need it. It
    reads its bound on pixels, for the formats image_size.py does not read, when imported."""
    os.environ.setdefault(MAX_PIXELS_VARIABLE, str(DEFAULT_MAX_PIXELS))
    try:
        import cv2 as module
    except ImportError:
        raise CaffeError('reading or writing images needs OpenCV: '
                         'pip install opencv-python-headless') from None
    return module


def _read_flag(color):
    """OpenCV's imread/imdecode flag: True colour (3 channels), False gray, None as stored."""
    flags = cv2()
    if color is None:
        return flags.IMREAD_ANYCOLOR
    return flags.IMREAD_COLOR if color else flags.IMREAD_GRAYSCALE


def hwc_to_chw(image):
    """An OpenCV image (H x W or H x W x C) as a C x H x W array."""
    return image[None] if image.ndim == 2 else image.transpose(2, 0, 1)


def imread(path, flag):
    """cv2.imread, or None where it cannot read the file. A name that is not UTF-8 (a
    file listed in another encoding) is read through Python and decoded: OpenCV's own
    imread crashes on such a name. An image over the bound on pixels, or one that OpenCV
    fails on (out of memory), is a CaffeError naming the file."""
    cv = cv2()
    require_regular(path, 'image file')
    what = 'image file %s' % quote(path)
    try:
        check_image_size(path, what)
    except OSError:
        return None
    try:
        try:
            path.encode('utf-8')
        except UnicodeEncodeError:
            try:
                payload = np.fromfile(path, np.uint8)
            except (OSError, ValueError):           # ValueError: a NUL in the name
                return None
            return cv.imdecode(payload, flag) if payload.size else None
        return cv.imread(path, flag)
    except cv.error as exc:
        raise CaffeError('OpenCV could not read %s: %s' % (what, opencv_reason(exc))) from None


def opencv_reason(exc):
    """One line for a cv2.error, whose message runs over several lines."""
    reason = getattr(exc, 'err', '') or ' '.join(str(exc).split())
    if 'CV_IO_MAX_IMAGE_PIXELS' in reason:
        return 'more than %d pixels (%s raises the bound)' % (max_image_pixels(),
                                                             MAX_PIXELS_VARIABLE)
    return reason if len(reason) <= 120 else reason[:117] + '...'


def listed(path, source, error=CaffeError):
    """``path``, a file that the list ``source`` names, if it exists and is a regular
    file; else an error that names the list too."""
    if not os.path.exists(path):
        raise error('%s, listed in %s, does not exist' % (quote(path), source))
    kind = not_regular(path)
    if kind is not None:
        raise error('%s, listed in %s, is not a regular file (%s)' % (quote(path), source, kind))
    return path


def read_image(path, color=True, height=0, width=0, interpolation=None):
    """Caffe's ReadImageToCVMat: the image at ``path`` as an OpenCV H x W (x C) uint8 array,
    resized (bilinear) to height x width when both are > 0."""
    image = imread(path, _read_flag(color))
    if image is None:
        raise CaffeError('could not open or decode image file %s' % quote(path))
    return resize(image, height, width, interpolation)


def resize(image, height, width, interpolation=None):
    if height > 0 and width > 0 and image.shape[:2] != (height, width):
        cv = cv2()
        image = cv.resize(image, (width, height),
                          interpolation=cv.INTER_LINEAR if interpolation is None else interpolation)
    return image


def decode_image(payload, color=None, what='encoded image'):
    """PNG/JPEG bytes as a C x H x W uint8 array."""
    cv = cv2()
    image = None
    if len(payload):                  # OpenCV raises on an empty buffer, says None otherwise
        check_image_size(payload, what)
        try:
            image = cv.imdecode(np.frombuffer(payload, np.uint8), _read_flag(color))
        except cv.error as exc:
            raise CaffeError('OpenCV could not decode %s (%d bytes): %s'
                             % (what, len(payload), opencv_reason(exc))) from None
    if image is None:
        raise CaffeError('could not decode %s (%d bytes): not a PNG, JPEG or other image file '
                         'that OpenCV reads' % (what, len(payload)))
    return hwc_to_chw(image)


def encode_image(image, encoding):
    """An OpenCV image as the bytes of a ``encoding`` ('png', 'jpg', ...) file."""
    ok, payload = cv2().imencode('.' + encoding, image)
    if not ok:
        raise CaffeError('OpenCV could not encode an image as %r' % encoding)
    return payload.tobytes()


def array_to_datum(array, label=0):
    """A Datum holding a C x H x W array: uint8 as raw ``data``, anything else as float_data."""
    array = np.asarray(array)
    if array.ndim != 3:
        raise CaffeError('a Datum holds a C x H x W array, got shape %s' % (array.shape,))
    datum = caffe_pb2.Datum(channels=array.shape[0], height=array.shape[1],
                            width=array.shape[2], label=int(label))
    if array.dtype == np.uint8:
        datum.data = np.ascontiguousarray(array).tobytes()
    else:
        datum.float_data.extend(array.astype(np.float32).ravel().tolist())
    return datum


def encoded_datum(payload, label=0):
    """A Datum holding the bytes of an image file; Caffe leaves its sizes unset."""
    return caffe_pb2.Datum(data=payload, label=int(label), encoded=True)


def parse_datum(value, where='record'):
    try:
        datum = caffe_pb2.Datum.FromString(value)
    except DecodeError:
        raise CaffeError('%s is not a Caffe Datum (%d bytes that do not parse)'
                         % (where, len(value))) from None
    # parsing keeps the last of a field given twice: the size tells, without a copy
    labels = _label_count(value) if datum.ByteSize() != len(value) else 1
    if labels > 1:
        raise CaffeError('%s holds %d labels (a fork\'s Datum whose label is repeated, as '
                         "caffe_ocr's); a Caffe Datum holds one, and its data layers read one"
                         % (where, labels))
    return datum


def _label_count(value):
    """How many times a Datum's wire bytes give field 5 (label), walking the fields."""
    count, at = 0, 0
    while at < len(value):
        key, at = _varint(value, at)
        number, wire_type = key >> 3, key & 7
        count += number == 5
        if wire_type == 0:
            _, at = _varint(value, at)
        elif wire_type == 2:
            length, at = _varint(value, at)
            at += length
        elif wire_type in (1, 5):               # fixed 64 or 32 bits (3, 4: group marks)
            at += 8 if wire_type == 1 else 4
    return count


def _varint(value, at):
    result, shift = 0, 0
    while True:
        byte = value[at]
        result |= (byte & 0x7f) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            return result, at


def record_name(key, path):
    """How errors name an LMDB record: its key (quoted, at most 80 characters) and the LMDB."""
    return 'record %s of %s' % (quote(key), path)


def datum_to_array(datum, color=None, where='record'):
    """The C x H x W array a Datum holds: uint8 pixels, or float32 for float_data.

    ``color`` applies to encoded records only: True forces 3 channels, False gray,
    None keeps the file's own channels (Caffe's force_color / force_gray).
    """
    if datum.encoded:
        return decode_image(datum.data, color, what=where)
    shape = (datum.channels, datum.height, datum.width)
    if min(shape) <= 0:
        raise CaffeError('%s: Datum has shape %s; channels, height and width must be > 0'
                         % (where, list(shape)))
    count = math.prod(shape)
    if datum.data:
        values = np.frombuffer(datum.data, np.uint8)
    else:
        values = np.asarray(datum.float_data, np.float32)
    if values.size != count:
        raise CaffeError('%s: Datum of shape %s holds %d values, expected %d'
                         % (where, list(shape), values.size, count))
    return values.reshape(shape)


class LMDBReader:
    """The values of an LMDB in key order, wrapping around to the first after the last.

    The records are read from data.mdb with every page checked (see lmdbfile.py), so a
    truncated or damaged database is a CaffeError, never a crash; lock.mdb is not needed
    (a folder copied from a read-only share works). One reader may move between threads
    (the prefetch thread of a pipeline), one at a time.
    """

    def __init__(self, path, what='LMDB'):
        self.path = path
        data_file = os.path.join(path, 'data.mdb')
        if not os.path.isdir(path) or not os.path.exists(data_file):
            raise CaffeError('%s %s not found (expected a folder holding data.mdb)'
                             % (what, quote(path)))
        require_regular(data_file, what)
        try:
            self.file = LMDBFile(data_file)
        except OSError as exc:
            raise CaffeError('cannot read %s %s: %s' % (what, quote(path), exc.strerror)) from None
        self.size = self.file.entries
        if self.size == 0:
            raise CaffeError('%s %s holds no records' % (what, path))
        self._pass = None              # the pass through the records in progress

    def records(self):
        """Every (key, value) in key order, once."""
        return self.file.records()

    def first(self):
        """The first (key, value), without moving the reader."""
        return next(self.records())

    def skip(self, count):
        self.next_records(count)

    def next_records(self, count):
        """The next ``count`` (key, value) pairs, wrapping around at the end."""
        records = []
        while len(records) < count:
            if self._pass is None:
                self._pass = self.records()
            record = next(self._pass, None)
            if record is None:
                self._pass = None
            else:
                records.append(record)
        return records


#: records per LMDB transaction of the converters, as Caffe's tools commit them
COMMIT_EVERY = 1000


def in_commits(records, log):
    """The (key, value) pairs of ``records`` in lists of COMMIT_EVERY, one transaction of
    write_lmdb each, with Caffe's 'Processed N files.' after each."""
    batch, done = [], 0
    for record in records:
        batch.append(record)
        done += 1
        if done % COMMIT_EVERY == 0:
            yield batch
            batch = []
            log('Processed %d files.' % done)
    if done % COMMIT_EVERY:
        yield batch
        log('Processed %d files.' % done)


def write_lmdb(path, batches, map_size=1 << 26):
    """Write the (key, value) pairs of each batch (one transaction per batch) into a new LMDB
    folder ``path``, atomically: the database is built in a temporary folder beside ``path``
    and renamed only when complete, so an interrupted run leaves no half database.
    The map grows (doubling) as needed."""
    import lmdb
    path = os.path.abspath(path)
    if os.path.exists(path):
        raise CaffeError('%s already exists; remove it or choose another name' % path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise CaffeError('the folder %s does not exist' % parent)
    tmp = tempfile.mkdtemp(prefix='.%s.' % os.path.basename(path), suffix='.tmp', dir=parent)
    try:
        env = lmdb.open(tmp, map_size=map_size, subdir=True)
        count = 0
        for batch in batches:
            batch = list(batch)
            while True:
                try:
                    with env.begin(write=True) as txn:
                        for key, value in batch:
                            txn.put(key, value)
                    break
                except lmdb.MapFullError:
                    map_size *= 2
                    env.set_mapsize(map_size)
            count += len(batch)
        env.close()
        os.chmod(tmp, 0o755)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return count
