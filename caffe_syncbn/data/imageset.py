"""Caffe's convert_imageset and compute_image_mean: image files to an LMDB, LMDB to a mean.

The LMDB holds one Datum per image under the key ``%08d_<file name>`` (the line number
in the list file, as Caffe writes it), so real Caffe reads it and this package reads
Caffe's. Both writes are atomic: an interrupted run leaves no half-written output.
"""
import os

import numpy as np

from ..errors import CaffeError, quote
from ..formats.atomic import atomic_write
from ..formats.blobs import array_to_blob
from ..formats.regular import require_regular
from .datum import (LMDBReader, array_to_datum, cv2, datum_to_array, encode_image, encoded_datum,
                    hwc_to_chw, imread, in_commits, parse_datum, record_name, write_lmdb)


def read_image_list(path, error=CaffeError):
    """[(file name, int label)] from "name label" lines; the label follows the LAST space,
    so names may hold spaces (Caffe's rule)."""
    require_regular(path, 'list file', error)
    try:
        with open(path, errors='surrogateescape') as f:     # file names in any encoding
            lines = [line.rstrip('\r\n') for line in f]
    except OSError as exc:
        raise error('cannot read list file %s: %s' % (quote(path), exc.strerror)) from None
    entries = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        name, _, label = line.strip().rpartition(' ')
        try:
            entries.append((name.strip(), int(label)))
        except ValueError:
            raise error('%s line %d: expected "<file> <integer label>", got %s'
                        % (path, number, quote(line))) from None
        if not name.strip():
            raise error('%s line %d: expected "<file> <integer label>", got %s'
                        % (path, number, quote(line)))
    if not entries:
        raise error('list file %s names no images' % quote(path))
    return entries


def image_to_datum(path, label, color=True, height=0, width=0, encoding=''):
    """Caffe's ReadImageToDatum: raw C x H x W pixels, or with ``encoding`` the image as
    a PNG/JPEG file (the file's own bytes when it already is one and is not resized)."""
    cv = cv2()
    image = imread(path, cv.IMREAD_COLOR if color else cv.IMREAD_GRAYSCALE)
    if image is None:
        return None
    if height > 0 and width > 0:
        image = cv.resize(image, (width, height))
    if not encoding:
        return array_to_datum(hwc_to_chw(image), label)
    extension = os.path.splitext(path)[1][1:].lower()
    same_kind = extension == encoding or (extension, encoding) in (('jpeg', 'jpg'), ('jpg', 'jpeg'))
    if same_kind and not (height > 0 and width > 0) and (image.ndim == 3) == color:
        with open(path, 'rb') as f:
            return encoded_datum(f.read(), label)
    return encoded_datum(encode_image(image, encoding), label)


def convert_imageset(root, list_file, db_path, resize_height=0, resize_width=0, gray=False,
                     shuffle=False, encoded=False, encode_type='', check_size=False, seed=0,
                     log=print, warn=print):
    """Write the images a list file names (relative to ``root``, joined as plain text like
    Caffe) into a new LMDB at ``db_path``. Unreadable images are reported and skipped.
    Returns the number of records written."""
    entries = read_image_list(list_file)
    if shuffle:
        order = np.random.RandomState(seed).permutation(len(entries))
        entries = [entries[i] for i in order]
    log('A total of %d images.' % len(entries))
    encode_type = encode_type.lower().lstrip('.')

    def records():
        size = None
        for line_id, (name, label) in enumerate(entries):
            encoding = encode_type
            if encoded and not encoding:
                encoding = os.path.splitext(name)[1][1:].lower()     # guess from the name
            datum = image_to_datum(root + name, label, not gray, resize_height, resize_width,
                                   encoding if encoded else '')
            if datum is None:
                warn('Could not open or find file %s' % (root + name))
                continue
            if check_size and not datum.encoded:
                if size is None:
                    size = (datum.channels, datum.height, datum.width)
                elif size != (datum.channels, datum.height, datum.width):
                    raise CaffeError('%s has size %s, the first image has %s (--check_size)'
                                     % (root + name, (datum.channels, datum.height,
                                                      datum.width), size))
            yield ('%08d_%s' % (line_id, name)).encode(), datum.SerializeToString()

    count = write_lmdb(db_path, in_commits(records(), log))
    if count == 0:
        raise CaffeError('no image of %s could be read (root folder %s)' % (list_file, quote(root)))
    return count


def compute_image_mean(db_path, mean_path=None, log=print):
    """The mean C x H x W image (float32) of every record of an LMDB; written to
    ``mean_path`` as a legacy 1 x C x H x W BlobProto (what Caffe's tool writes) if given."""
    reader = LMDBReader(db_path)
    total, shape, count = None, None, 0
    for key, value in reader.records():
        where = record_name(key, db_path)
        image = datum_to_array(parse_datum(value, where), where=where)
        if total is None:
            shape = image.shape
            total = np.zeros(shape, np.float64)
        elif image.shape != shape:
            raise CaffeError('%s has shape %s, the first record has %s: every image needs '
                             'the same size' % (where, list(image.shape), list(shape)))
        total += image
        count += 1
        if count % 10000 == 0:
            log('Processed %d files.' % count)
    mean = (total / count).astype(np.float32)
    log('Number of channels: %d' % shape[0])
    for c in range(shape[0]):
        log('mean_value channel [%d]: %g' % (c, mean[c].mean()))
    if mean_path is not None:
        write_mean_file(mean_path, mean)
    return mean


def write_mean_file(path, mean):
    """Write a C x H x W mean as Caffe's tools do: a BlobProto with num 1, channels, height,
    width (legacy fields, which every pycaffe version reads)."""
    proto = array_to_blob(np.asarray(mean, np.float32).reshape(-1))
    proto.ClearField('shape')
    proto.num, (proto.channels, proto.height, proto.width) = 1, mean.shape
    with atomic_write(path) as f:
        f.write(proto.SerializeToString())
    return proto
