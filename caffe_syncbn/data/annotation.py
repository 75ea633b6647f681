"""AnnotatedDatum records (an image with labelled boxes, as the SSD fork stores them in
LMDB) and convert_annoset, which writes them from an image list and annotation files.

Boxes travel as rows ``[group_label, instance_id, xmin, ymin, xmax, ymax, difficult]``
(float64, coordinates normalized by the image size), in the record's order: group by
group, box by box. A group holds the boxes of one label, numbered from 0 by instance_id
in the order the annotation file lists them.

Annotation files (``label_type``):
  xml   PASCAL VOC: <size> (else the image's own), <object> with <name> (through the
        label map), <difficult> and <bndbox> integer pixel corners; an object's
        <difficult> counts only when it comes before its <bndbox>, as in the fork
  txt   one box a line: ``label xmin ymin xmax ymax`` in pixels of the original image
  json  ``{"image": {"height", "width"}, "annotation": [{"bbox": [x, y, w, h],
        "category_id": name, "iscrowd": 0 or 1}]}`` (COCO-like; the category id is a
        name of the label map; crowd boxes are difficult)
A listed annotation file that does not exist gives an image without boxes.
"""
import json
import os
import xml.etree.ElementTree as ElementTree

import numpy as np
from google.protobuf import text_format
from google.protobuf.message import DecodeError

from .. import caffe_pb2
from ..errors import CaffeError, quote
from .datum import cv2, encode_image, hwc_to_chw, imread, in_commits, write_lmdb

ROW_WIDTH = 7
LABEL_TYPES = ('xml', 'txt', 'json')


def parse_annotated_datum(value, where='record'):
    try:
        record = caffe_pb2.AnnotatedDatum.FromString(value)
    except DecodeError:
        raise CaffeError('%s is not an AnnotatedDatum (%d bytes that do not parse)'
                         % (where, len(value))) from None
    if not record.HasField('datum'):
        raise CaffeError('%s is an AnnotatedDatum without an image (datum)' % where)
    return record


def annotation_rows(record):
    """(boxes, 7) rows of an AnnotatedDatum (see the module docstring)."""
    rows = [[group.group_label, box.instance_id, box.bbox.xmin, box.bbox.ymin, box.bbox.xmax,
             box.bbox.ymax, float(box.bbox.difficult)]
            for group in record.annotation_group for box in group.annotation]
    return np.array(rows, np.float64).reshape(-1, ROW_WIDTH)


def set_annotations(record, labelled_boxes):
    """Fill ``record``'s groups from (label, (xmin, ymin, xmax, ymax), difficult) in file
    order: a new label opens a group, each box gets the next instance_id of its group."""
    record.ClearField('annotation_group')
    groups = {}
    for label, box, difficult in labelled_boxes:
        if label not in groups:
            groups[label] = record.annotation_group.add(group_label=label)
        group = groups[label]
        instance = group.annotation[-1].instance_id + 1 if len(group.annotation) else 0
        annotation = group.annotation.add(instance_id=instance)
        annotation.bbox.xmin, annotation.bbox.ymin, annotation.bbox.xmax, annotation.bbox.ymax = box
        annotation.bbox.difficult = bool(difficult)


def read_label_map(path):
    """{name: label} of a LabelMap prototxt (labelmap_voc.prototxt and the like)."""
    label_map = caffe_pb2.LabelMap()
    try:
        with open(path) as f:
            text_format.Parse(f.read(), label_map)
    except OSError as exc:
        raise CaffeError('cannot read the label map %s: %s' % (quote(path), exc.strerror)) from None
    except text_format.ParseError as exc:
        raise CaffeError('label map %s is not a LabelMap prototxt: %s' % (quote(path), exc)) from None
    return {item.name: item.label for item in label_map.item}


def normalized(xmin, ymin, xmax, ymax, width, height):
    """Pixel corners divided by the image size in float32, as the fork stores them."""
    f32 = np.float32
    return tuple(float(f32(value) / f32(size)) for value, size in
                 ((xmin, width), (ymin, height), (xmax, width), (ymax, height)))


def _pixel(element, field, path):
    text = element.findtext(field, default='0').strip()
    try:
        return int(text)
    except ValueError:
        raise CaffeError('%s: bndbox %s is %r, expected a whole number of pixels'
                         % (quote(path), field, text)) from None


def read_voc_xml(path, image_height, image_width, name_to_label):
    """Labelled boxes of a VOC annotation file, normalized by its <size> (else the image's)."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError) as exc:
        raise CaffeError('cannot read the annotation file %s: %s' % (quote(path), exc)) from None
    height = int(root.findtext('size/height') or image_height)
    width = int(root.findtext('size/width') or image_width)
    if not height or not width:
        raise CaffeError('%s: no valid image width/height' % quote(path))
    boxes = []
    for obj in root.findall('object'):
        label, difficult = None, False
        for child in obj:
            if child.tag == 'name':
                name = (child.text or '').strip()
                if name not in name_to_label:
                    raise CaffeError('%s: object name %s is not in the label map'
                                     % (quote(path), quote(name)))
                label = name_to_label[name]
            elif child.tag == 'difficult':
                difficult = (child.text or '').strip() == '1'
            elif child.tag == 'bndbox':
                if label is None:
                    raise CaffeError('%s: an object has its bndbox before its name' % quote(path))
                xmin, ymin, xmax, ymax = (_pixel(child, f, path)
                                          for f in ('xmin', 'ymin', 'xmax', 'ymax'))
                boxes.append((label, normalized(xmin, ymin, xmax, ymax, width, height),
                              difficult))
    return boxes


def read_txt_boxes(path, image_height, image_width):
    """Labelled boxes of a ``label xmin ymin xmax ymax`` file, normalized by the image size."""
    with open(path) as f:
        values = f.read().split()
    boxes = []
    for start in range(0, len(values) - len(values) % 5, 5):
        try:
            label = int(values[start])
            xmin, ymin, xmax, ymax = (float(v) for v in values[start + 1:start + 5])
        except ValueError:
            raise CaffeError('%s: box %d is %s, expected "label xmin ymin xmax ymax"'
                             % (quote(path), start // 5 + 1, ' '.join(values[start:start + 5])))
        boxes.append((label, normalized(xmin, ymin, xmax, ymax, image_width, image_height),
                      False))
    return boxes


def read_json_boxes(path, image_height, image_width, name_to_label):
    """Labelled boxes of a COCO-like json file (see the module docstring)."""
    try:
        with open(path) as f:
            content = json.load(f)
        height = int(content.get('image', {}).get('height', image_height))
        width = int(content.get('image', {}).get('width', image_width))
        boxes = []
        for entry in content.get('annotation', []):
            name = str(entry['category_id'])
            if name not in name_to_label:
                raise CaffeError('%s: category_id %s is not in the label map'
                                 % (quote(path), quote(name)))
            x, y, w, h = (np.float32(v) for v in entry['bbox'])
            boxes.append((name_to_label[name], normalized(x, y, x + w, y + h, width, height),
                          bool(entry.get('iscrowd', 0))))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CaffeError('cannot read the json annotation %s: %s' % (quote(path), exc)) from None
    return boxes


def load_image(path, color, resize_height=0, resize_width=0, min_dim=0, max_dim=0):
    """The fork's image read for its tools: OpenCV image, resized to height x width, or
    scaled (keeping the aspect) so the short side reaches min_dim and the long side
    stays within max_dim; None when the file cannot be read."""
    cv = cv2()
    image = imread(path, cv.IMREAD_COLOR if color else cv.IMREAD_GRAYSCALE)
    if image is None:
        return None
    if min_dim > 0 or max_dim > 0:
        short, long = min(image.shape[:2]), max(image.shape[:2])
        factor = np.float32(1)
        if min_dim > 0 and short < min_dim:
            factor = np.float32(min_dim) / np.float32(short)
        if max_dim > 0 and int(factor * long) > max_dim:
            factor = np.float32(max_dim) / np.float32(long)
        if factor != 1:
            image = cv.resize(image, (0, 0), fx=float(factor), fy=float(factor))
    elif resize_height > 0 and resize_width > 0:
        image = cv.resize(image, (resize_width, resize_height))
    return image


def annotated_datum(image_path, label_path, label_type, name_to_label, color=True,
                    resize_height=0, resize_width=0, min_dim=0, max_dim=0, encoding=''):
    """The AnnotatedDatum of one image and its annotation file, or None when the image
    cannot be read. Boxes are normalized by the original image size (before resizing)."""
    image = load_image(image_path, color, resize_height, resize_width, min_dim, max_dim)
    if image is None:
        return None
    record = caffe_pb2.AnnotatedDatum(type=caffe_pb2.AnnotatedDatum.BBOX)
    datum = record.datum
    datum.channels = image.shape[2] if image.ndim == 3 else 1
    datum.height, datum.width = image.shape[:2]
    datum.label = -1
    if encoding:
        datum.data, datum.encoded = encode_image(image, encoding), True
    else:
        datum.data, datum.encoded = np.ascontiguousarray(hwc_to_chw(image)).tobytes(), False
    if not os.path.isfile(label_path):
        return record
    original = imread(image_path, cv2().IMREAD_COLOR)
    height, width = original.shape[:2]
    if label_type == 'xml':
        boxes = read_voc_xml(label_path, height, width, name_to_label)
    elif label_type == 'txt':
        boxes = read_txt_boxes(label_path, height, width)
    elif label_type == 'json':
        boxes = read_json_boxes(label_path, height, width, name_to_label)
    else:
        raise CaffeError('unknown label_type %s (expected one of %s)'
                         % (quote(label_type), ', '.join(LABEL_TYPES)))
    set_annotations(record, boxes)
    return record


def read_annotated_list(path):
    """(image, annotation file) pairs of a convert_annoset list, one pair a line."""
    try:
        with open(path) as f:
            words = f.read().split()
    except OSError as exc:
        raise CaffeError('cannot read the list file %s: %s' % (quote(path), exc.strerror)) from None
    if len(words) % 2:
        raise CaffeError('list file %s must hold "image annotation" pairs, got %d names'
                         % (quote(path), len(words)))
    if not words:
        raise CaffeError('list file %s names no images' % quote(path))
    return list(zip(words[0::2], words[1::2]))


def convert_annoset(root, list_file, db_path, label_map_file='', label_type='xml', gray=False,
                    shuffle=False, resize_height=0, resize_width=0, min_dim=0, max_dim=0,
                    encoded=False, encode_type='', check_size=False, seed=0, log=print,
                    warn=print):
    """Write the images and annotation files a list names (both relative to ``root``,
    joined as plain text) into a new LMDB of AnnotatedDatum records, keyed
    ``%08d_<image name>`` as the fork's tool does. Returns the number of records."""
    if label_type not in LABEL_TYPES:
        raise CaffeError('unknown label_type %s (expected one of %s)'
                         % (quote(label_type), ', '.join(LABEL_TYPES)))
    name_to_label = read_label_map(label_map_file) if label_map_file else {}
    if label_type in ('xml', 'json') and not name_to_label:
        raise CaffeError('%s annotations name their classes: give a label map file' % label_type)
    entries = read_annotated_list(list_file)
    if shuffle:
        order = np.random.RandomState(seed).permutation(len(entries))
        entries = [entries[i] for i in order]
    log('A total of %d images.' % len(entries))
    encode_type = encode_type.lower().lstrip('.')
    encoded = encoded or bool(encode_type)

    def records():
        size = None
        for line_id, (image_name, label_name) in enumerate(entries):
            encoding = (encode_type or os.path.splitext(image_name)[1][1:].lower()) if encoded else ''
            record = annotated_datum(root + image_name, root + label_name, label_type,
                                     name_to_label, not gray, resize_height, resize_width,
                                     min_dim, max_dim, encoding)
            if record is None:
                warn('Could not read %s' % (root + image_name))
                continue
            datum = record.datum
            if check_size:
                shape = (datum.channels, datum.height, datum.width)
                if size is None:
                    size = shape
                elif shape != size:
                    raise CaffeError('%s has size %s, the first image has %s (--check_size)'
                                     % (root + image_name, shape, size))
            yield ('%08d_%s' % (line_id, image_name)).encode(), record.SerializeToString()

    count = write_lmdb(db_path, in_commits(records(), log))
    if count == 0:
        raise CaffeError('no image of %s could be read (root folder %s)'
                         % (list_file, quote(root)))
    return count
