"""Caffe's Datum records and the LMDB databases that hold them.

A Datum is one sample: ``data`` holds uint8 pixels in C x H x W order (BGR for colour
images, as OpenCV reads them), or the bytes of a PNG/JPEG file when ``encoded`` is set;
``float_data`` replaces ``data`` for float input. Images go through OpenCV, as in Caffe,
so pixel values (JPEG decoding, resizing) match what Caffe's tools produce.
"""
import os
import threading

import numpy as np

from .. import caffe_pb2
from ..errors import CaffeError


def cv2():
    """OpenCV, imported on first use: only image files and encoded records need it."""
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


def read_image(path, color=True, height=0, width=0, interpolation=None):
    """Caffe's ReadImageToCVMat: the image at ``path`` as an OpenCV H x W (x C) uint8 array,
    resized (bilinear) to height x width when both are > 0."""
    image = cv2().imread(path, _read_flag(color))
    if image is None:
        raise CaffeError('could not open or decode image file %s' % path)
    return resize(image, height, width, interpolation)


def resize(image, height, width, interpolation=None):
    if height > 0 and width > 0 and image.shape[:2] != (height, width):
        cv = cv2()
        image = cv.resize(image, (width, height),
                          interpolation=cv.INTER_LINEAR if interpolation is None else interpolation)
    return image


def decode_image(payload, color=None, what='encoded image'):
    """PNG/JPEG bytes as a C x H x W uint8 array."""
    image = cv2().imdecode(np.frombuffer(payload, np.uint8), _read_flag(color))
    if image is None:
        raise CaffeError('could not decode %s (%d bytes)' % (what, len(payload)))
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
        return caffe_pb2.Datum.FromString(value)
    except Exception as exc:
        raise CaffeError('%s is not a Caffe Datum: %s' % (where, exc)) from None


def datum_to_array(datum, color=None, where='record'):
    """The C x H x W array a Datum holds: uint8 pixels, or float32 for float_data.

    ``color`` applies to encoded records only: True forces 3 channels, False gray,
    None keeps the file's own channels (Caffe's force_color / force_gray).
    """
    if datum.encoded:
        return decode_image(datum.data, color, what=where)
    shape = (datum.channels, datum.height, datum.width)
    count = int(np.prod(shape))
    if datum.data:
        values = np.frombuffer(datum.data, np.uint8)
    else:
        values = np.asarray(datum.float_data, np.float32)
    if values.size != count:
        raise CaffeError('%s: Datum of shape %s holds %d values, expected %d'
                         % (where, list(shape), values.size, count))
    return values.reshape(shape)


_ENVIRONMENTS = {}
_ENVIRONMENTS_LOCK = threading.Lock()


def open_lmdb(path):
    """The read-only environment of the LMDB folder ``path``, shared process-wide: LMDB
    allows one open environment per database and process, and a train net, a test net and
    every replica may read the same one. Keyed by the data file's identity, so a database
    rebuilt at the same path is opened afresh."""
    import lmdb
    info = os.stat(os.path.join(path, 'data.mdb'))
    key = (info.st_dev, info.st_ino)
    with _ENVIRONMENTS_LOCK:
        env = _ENVIRONMENTS.get(key)
        if env is None:
            env = lmdb.open(path, readonly=True, lock=False, readahead=False, subdir=True,
                            max_readers=126)
            _ENVIRONMENTS[key] = env
        return env


class LMDBReader:
    """The values of an LMDB in key order, wrapping around to the first after the last.

    The database is opened read-only without locking (lock.mdb may be absent, as in a
    folder copied from a read-only share). Each read takes a short transaction, so the
    reader can move between threads (the prefetch thread of a pipeline).
    """

    def __init__(self, path, what='LMDB'):
        import lmdb
        self.path = path
        if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, 'data.mdb')):
            raise CaffeError('%s %s not found (expected a folder holding data.mdb)' % (what, path))
        try:
            self.env = open_lmdb(path)
        except lmdb.Error as exc:
            raise CaffeError('cannot open %s %s: %s' % (what, path, exc)) from None
        self.size = self.env.stat()['entries']
        if self.size == 0:
            raise CaffeError('%s %s holds no records' % (what, path))
        self._next_key = None          # None: start at the first key

    def first(self):
        """The first (key, value), without moving the reader."""
        with self.env.begin(buffers=False) as txn:
            cursor = txn.cursor()
            cursor.first()
            return cursor.key(), cursor.value()

    def skip(self, count):
        self.next_records(count)

    def next_records(self, count):
        """The next ``count`` (key, value) pairs, wrapping around at the end."""
        records = []
        with self.env.begin(buffers=False) as txn:
            cursor = txn.cursor()
            found = cursor.set_range(self._next_key) if self._next_key is not None else False
            if not found:
                cursor.first()
            while len(records) < count:
                records.append((cursor.key(), cursor.value()))
                if not cursor.next():
                    cursor.first()
            self._next_key = cursor.key()
        return records


def write_lmdb(path, batches, map_size=1 << 26):
    """Write the (key, value) pairs of each batch (one transaction per batch) into a new LMDB
    folder ``path``, atomically: the database is built in a temporary folder beside ``path``
    and renamed only when complete, so an interrupted run leaves no half database.
    The map grows (doubling) as needed."""
    import shutil
    import tempfile

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
