"""AnnotatedData: the SSD fork's data layer, on an LMDB of AnnotatedDatum records (what
its convert_annoset, or tools/convert_annoset.py here, writes).

Tops: data (N x C x h x w) and, optionally, the boxes as one (1, 1, boxes, 8) blob of
rows [item_id, group_label, instance_id, xmin, ymin, xmax, ymax, difficult], item_id
being the image's place in its batch; a batch without any box gets one row of -1.

Each image goes through the fork's steps (data/box_augment.py): distort_param, then
expand_param, then a crop from the batch samplers, then transform_param's resize_param
(WARP), crop_size (random in TRAIN, centred in TEST) and mirror, and finally
(pixel - mean) * scale. The mean of a mean_file is taken at the output position (after
the mirror), as the fork's AnnotatedData does. The fork applies the augmentations in
every phase when they are set; so does this layer.

Data parallelism: one reader draws the global batch; ``next_batches(sizes)`` numbers each
replica's item ids from 0, which is what MultiBoxLoss on that replica expects.
"""
import numpy as np

from ... import caffe_pb2
from ...caffe_pb2 import TRAIN
from ...data.annotation import annotation_rows, parse_annotated_datum
from ...data.box_augment import (UNIT_BOX, check_sampler, distort, expand, mirror_boxes,
                                 project_boxes, random_crop)
from ...data.datum import LMDBReader, cv2, datum_to_array, record_name
from ...data.transform import load_mean_file
from ...errors import CaffeError
from ...layer import register
from .image_data import ImageDataLayer, SampleStream

RESIZE = caffe_pb2.ResizeParameter
INTERPOLATIONS = {RESIZE.LINEAR: 'INTER_LINEAR', RESIZE.AREA: 'INTER_AREA',
                  RESIZE.NEAREST: 'INTER_NEAREST', RESIZE.CUBIC: 'INTER_CUBIC',
                  RESIZE.LANCZOS4: 'INTER_LANCZOS4'}
LABEL_WIDTH = 8


class AnnotatedReader(SampleStream):
    """AnnotatedDatum records in key order, each transformed with its own generator."""

    def __init__(self, layer, db, rng=None):
        self.layer, self.db = layer, db
        self.rng = layer.reader_rng(rng)
        self.start_stream(self.rng)
        if layer.param.data_param.rand_skip:
            self.db.skip(self.rng.randint(layer.param.data_param.rand_skip))

    def pass_over(self, n):
        self.db.skip(n)

    def next_batch(self, n):
        return self.next_batches([n])[0]

    def next_batches(self, sizes):
        """One (data, labels) batch per entry of ``sizes``; each numbers its images from 0."""
        records = self.db.next_records(sum(sizes))
        samples = [self.layer.sample(key, value, rng)
                   for (key, value), rng in zip(records, self.sample_rngs(len(records)))]
        batches, start = [], 0
        for size in sizes:
            batches.append(self.layer.batch(samples[start:start + size]))
            start += size
        return batches


@register('AnnotatedData')
class AnnotatedDataLayer(ImageDataLayer):

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.check_tops(top, minimum=1, maximum=2)
        p = self.param.data_param
        if p.backend != p.LMDB:
            raise self.error('data_param.backend %s is not supported; only LMDB is'
                             % p.DB.Name(p.backend))
        self.batch_size = self.check_batch_size(p.batch_size, 'data_param.batch_size')
        t = self.param.transform_param
        self.transform = t
        if t.HasField('noise_param'):
            raise self.error('transform_param.noise_param is not implemented')
        if t.force_color and t.force_gray:
            raise self.error('transform_param: force_color and force_gray cannot both be set')
        self.color = True if t.force_color else (False if t.force_gray else None)
        if t.HasField('resize_param'):
            r = t.resize_param
            if r.resize_mode != RESIZE.WARP:
                raise self.error('resize_param.resize_mode %s is not implemented (only WARP)'
                                 % RESIZE.Resize_mode.Name(r.resize_mode))
            if r.height <= 0 or r.width <= 0:
                raise self.error('resize_param needs height and width > 0, got %d x %d'
                                 % (r.height, r.width))
        self.mean_image = load_mean_file(t.mean_file, self.error) if t.mean_file else None
        if self.mean_image is not None and t.mean_value:
            raise self.error('transform_param: give mean_file or mean_value, not both')
        if self.mean_image is not None and t.HasField('expand_param'):
            raise self.error('expand_param with a mean_file is not implemented (use mean_value)')
        self.mean_values = np.asarray(t.mean_value, np.float64)
        self.emit = t.emit_constraint if t.HasField('emit_constraint') else None
        anno = self.param.annotated_data_param
        if anno.HasField('anno_type') and anno.anno_type != caffe_pb2.AnnotatedDatum.BBOX:
            raise self.error('annotated_data_param.anno_type must be BBOX')
        self.samplers = list(anno.batch_sampler)
        for sampler in self.samplers:
            check_sampler(sampler, self.error)
        self.source = p.source
        key, value = self._open().first()
        image = self.decode(key, value)[0]
        if t.HasField('distort_param') and (image.ndim != 3 or image.shape[2] != 3):
            raise self.error('distort_param needs colour (3-channel) images')
        height, width = self.resized_size(image)
        channels = image.shape[2] if image.ndim == 3 else 1
        if t.crop_size:
            height = width = t.crop_size
        self.sample_shape = (channels, height, width)
        top[0].reshape((self.batch_size,) + self.sample_shape)
        if len(top) > 1:
            top[1].reshape((1, 1, 1, LABEL_WIDTH))

    def _open(self):
        try:
            return LMDBReader(self.source, 'LMDB (data_param.source)')
        except CaffeError as exc:
            raise self.error(str(exc)) from None

    def make_reader(self, rng=None):
        return AnnotatedReader(self, self._open(), rng)

    def decode(self, key, value):
        """(H x W (x C) uint8 image, annotation rows) of one record."""
        where = record_name(key, self.source)
        try:
            record = parse_annotated_datum(value, where)
            image = datum_to_array(record.datum, self.color, where)
        except CaffeError as exc:
            raise self.error(str(exc)) from None
        if image.dtype != np.uint8:
            raise self.error('%s holds float_data; AnnotatedData reads uint8 images' % where)
        image = image[0] if image.shape[0] == 1 else image.transpose(1, 2, 0)
        return np.ascontiguousarray(image), annotation_rows(record)

    def resized_size(self, image):
        if self.transform.HasField('resize_param'):
            return self.transform.resize_param.height, self.transform.resize_param.width
        return image.shape[:2]

    def sample(self, key, value, rng):
        """(C x h x w float64 pixels, rows) of one record after every step."""
        t = self.transform
        image, rows = self.decode(key, value)
        if t.HasField('distort_param'):
            image = distort(image, t.distort_param, rng)
        if t.HasField('expand_param'):
            image, rows = expand(image, rows, t.expand_param, self.mean_values, rng, self.emit)
        if self.samplers:
            image, rows = random_crop(image, rows, self.samplers, rng, self.emit)
        if t.HasField('resize_param'):
            image = self.resize(image, t.resize_param, rng)
        return self.crop_and_mirror(image, rows, rng)

    def resize(self, image, param, rng):
        """WARP to height x width, with one of the interp_modes picked at random."""
        cv = cv2()
        modes = list(param.interp_mode) or [RESIZE.LINEAR]
        mode = modes[rng.randint(len(modes))]
        shape = image.shape
        out = cv.resize(image, (param.width, param.height),
                        interpolation=getattr(cv, INTERPOLATIONS[mode]))
        return out.reshape((param.height, param.width) + shape[2:])

    def crop_and_mirror(self, image, rows, rng):
        t = self.transform
        height, width = image.shape[:2]
        crop_h, crop_w = (t.crop_size, t.crop_size) if t.crop_size else (height, width)
        if height < crop_h or width < crop_w:
            raise self.error('crop_size %d is larger than an image of %d x %d'
                             % (t.crop_size, height, width))
        if t.crop_size and self.phase == TRAIN:
            top, left = rng.randint(height - crop_h + 1), rng.randint(width - crop_w + 1)
        else:
            top, left = (height - crop_h) // 2, (width - crop_w) // 2
        flip = bool(t.mirror and rng.randint(2))
        crop = np.array([left / width, top / height, (left + crop_w) / width,
                         (top + crop_h) / height]) if t.crop_size else UNIT_BOX
        if t.HasField('resize_param'):      # a warp keeps boxes, cut at the image's edges
            rows = rows.copy()
            rows[:, 2:4] = np.maximum(rows[:, 2:4], 0)
            rows[:, 4:6] = np.minimum(rows[:, 4:6], 1)
        rows = project_boxes(rows, crop, self.emit)
        pixels = image[top:top + crop_h, left:left + crop_w]
        pixels = (pixels[..., None] if pixels.ndim == 2 else pixels).transpose(2, 0, 1)
        if flip:
            pixels, rows = pixels[:, :, ::-1], mirror_boxes(rows)
        pixels = pixels.astype(np.float64)
        if self.mean_image is not None:
            if self.mean_image.shape != (pixels.shape[0], height, width):
                raise self.error('mean_file has shape %s but the images are %s'
                                 % (list(self.mean_image.shape), [pixels.shape[0], height, width]))
            pixels -= self.mean_image[:, top:top + crop_h, left:left + crop_w]
        elif len(self.mean_values):
            if len(self.mean_values) not in (1, pixels.shape[0]):
                raise self.error('transform_param: give 1 mean_value or one per channel (%d), '
                                 'got %d' % (pixels.shape[0], len(self.mean_values)))
            pixels -= np.broadcast_to(self.mean_values, (pixels.shape[0],))[:, None, None]
        return pixels * t.scale, rows

    def batch(self, samples):
        """(data, labels) of samples of one replica, item ids from 0."""
        shapes = {pixels.shape for pixels, _ in samples}
        if len(shapes) > 1:
            raise self.error('images of different sizes %s in one batch: set '
                             'transform_param.resize_param or crop_size' % sorted(shapes))
        if samples:
            data = np.stack([pixels for pixels, _ in samples]).astype(self.dtype)
        else:
            data = np.zeros((0,) + self.sample_shape, self.dtype)
        labels = [np.column_stack([np.full(len(rows), item), rows])
                  for item, (_, rows) in enumerate(samples) if len(rows)]
        if labels:
            labels = np.concatenate(labels)
        else:
            labels = np.full((1, LABEL_WIDTH), -1.0)
        out = [data, labels.reshape(1, 1, -1, LABEL_WIDTH).astype(self.dtype)]
        return out[:len(self.param.top)]
