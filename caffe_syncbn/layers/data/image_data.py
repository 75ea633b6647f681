"""Image data layers: Data (LMDB of Datum), ImageData (list of image files) and MemoryData
(arrays from the caller); the SampleStream and ImageDataLayer that SegData (seg_data.py) and
AnnotatedData (annotated_data.py) build on.

Each is a DataLayer (see layers.py): ``make_reader()`` gives a reader whose
``next_batch(n)`` decodes and transforms the next n samples, so one input pipeline can
draw the global batch of a data-parallel run. A net used on its own (no feeder) reads
one batch ahead in a background thread while it computes on the current one.

Sharding: a reader's ``skip(n)`` passes over n samples without decoding them, and the
random draws of sample i of the stream (crop, flip, scale) come from a generator of its
own, keyed by the reader's seed and i. So a process that skips the other processes' rows
of each global batch decodes only its own samples and transforms them exactly as one
process reading everything would.
"""
import concurrent.futures as futures

import numpy as np

from ...data.datum import (LMDBReader, datum_to_array, hwc_to_chw, listed, parse_datum, read_image,
                           record_name)
from ...data.imageset import read_image_list
from ...data.transform import DataTransformer
from ...errors import CaffeError
from ...layer import register
from .layers import DataLayer


class Prefetcher:
    """Serves batches of ``n`` from ``reader``, reading the next one in a background thread.

    One read at a time, in order, so the batches and the reader's random draws are the
    same as without prefetching. The thread ends when the Prefetcher is collected.
    """

    def __init__(self, reader, n):
        self.reader, self.n = reader, n
        self._executor = futures.ThreadPoolExecutor(1, thread_name_prefix='prefetch')
        self._pending = None

    def next_batch(self, n):
        if n != self.n:
            raise ValueError('this prefetcher serves batches of %d, not %d' % (self.n, n))
        pending = self._pending or self._executor.submit(self.reader.next_batch, n)
        self._pending = self._executor.submit(self.reader.next_batch, n)
        return pending.result()


class ImageDataLayer(DataLayer):
    """Base of the layers here: a reader seeded from the layer's rng, prefetching alone."""

    #: whether a net used alone reads ahead (not MemoryData: its arrays can change)
    prefetch = True

    def forward(self, bottom, top):
        if self.ctx.feeder is None and self._reader is None and self.prefetch:
            self._reader = Prefetcher(self.make_reader(), self.batch_size)
        super().forward(bottom, top)

    def reader_rng(self, rng=None):
        return rng if rng is not None else np.random.RandomState(self.ctx.rng.randint(2 ** 31 - 1))

    def check_batch_size(self, value, field):
        if value <= 0:
            raise self.error('%s must be > 0, got %d' % (field, value))
        return int(value)


class SampleStream:
    """A reader's place in its stream of samples (skipped ones count), and the generator
    of each sample's random draws (see the module docstring)."""

    def start_stream(self, rng):
        self.sample_seed, self.index = rng.randint(2 ** 31 - 1), 0

    def sample_rngs(self, n):
        first, self.index = self.index, self.index + n
        return [np.random.RandomState(np.random.Philox(key=[self.sample_seed, i]))
                for i in range(first, first + n)]

    def skip(self, n):
        """Pass over the next n samples without decoding them."""
        self.pass_over(n)
        self.index += n


class TransformedReader(SampleStream):
    """Shared part of the Data and ImageData readers: samples -> transformed batch + labels."""

    def __init__(self, layer, sample_shape, with_labels, rng=None):
        self.rng = layer.reader_rng(rng)
        self.transformer = DataTransformer(layer.param.transform_param, layer.phase, self.rng,
                                           layer.error)
        self.start_stream(self.rng)
        self.dtype = layer.dtype
        self.sample_shape = tuple(sample_shape)
        self.out_shape = self.transformer.output_shape(*sample_shape)
        self.with_labels = with_labels

    def next_batch(self, n):
        return self.batch(*self.read(n), self.sample_rngs(n))

    def next_batches(self, sizes):
        """One batch per entry of ``sizes`` (see parallel.read_parts). Images of one size, or
        cropped to one, are transformed together: the crops and flips drawn are those of
        one device reading them all. Whole images of several sizes are batched per device,
        where they must agree."""
        images, labels = self.read(sum(sizes))
        rngs = self.sample_rngs(len(images))
        bounds = np.cumsum([0] + list(sizes))
        if self.transformer.crop_size or len({image.shape for image in images}) <= 1:
            return [list(rows) for rows in zip(*(np.split(a, bounds[1:-1])
                                                 for a in self.batch(images, labels, rngs)))]
        return [self.batch(images[a:b], labels[a:b], rngs[a:b])
                for a, b in zip(bounds[:-1], bounds[1:])]

    def batch(self, images, labels, rngs):
        if not images:
            data = np.zeros((0,) + self.out_shape, self.dtype)
        else:
            data = self.transformer(images, self.dtype, rngs)
        return [data, np.asarray(labels, self.dtype)] if self.with_labels else [data]


class DatumReader(TransformedReader):
    def __init__(self, layer, shape, db, rng=None):
        super().__init__(layer, shape, len(layer.param.top) > 1, rng)
        p = layer.param.data_param
        self.db = db
        if p.rand_skip:
            self.db.skip(self.rng.randint(p.rand_skip))

    def pass_over(self, n):
        self.db.skip(n)

    def read(self, n):
        images, labels = [], []
        for key, value in self.db.next_records(n):
            where = record_name(key, self.db.path)
            datum = parse_datum(value, where)
            images.append(self.same_shape(datum_to_array(datum, self.transformer.color, where),
                                          where))
            labels.append(datum.label)
        return images, labels

    def same_shape(self, image, where):
        """``image``, if it has the channels of the first record, and its height and width
        too where there is no crop_size (Caffe's rule: a crop may come from any size)."""
        crop, first = self.transformer.crop_size, self.sample_shape
        if image.shape[0] != first[0] or (not crop and image.shape != first):
            raise self.transformer.error(
                '%s has shape %s, the first record %s: every record needs the first one\'s %s'
                % (where, list(image.shape), list(first),
                   'channels' if crop else 'shape (or a crop_size, to take windows of any size)'))
        return image


@register('Data')
class LMDBDataLayer(ImageDataLayer):
    """Caffe's Data layer on an LMDB of Datum records (raw or encoded), read in key order."""

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.check_tops(top, minimum=1, maximum=2)
        p = self.param.data_param
        if p.backend != p.LMDB:
            raise self.error('data_param.backend %s is not supported; only LMDB is (convert '
                             'the database, e.g. with tools/convert_imageset.py --backend lmdb)'
                             % p.DB.Name(p.backend))
        self.batch_size = self.check_batch_size(p.batch_size, 'data_param.batch_size')
        db = self._open()
        key, value = db.first()
        where = record_name(key, p.source)
        transformer = DataTransformer(self.param.transform_param, self.phase, None, self.error)
        self.sample_shape = datum_to_array(parse_datum(value, where), transformer.color,
                                           where).shape
        top[0].reshape((self.batch_size,) + transformer.output_shape(*self.sample_shape))
        if len(top) > 1:
            top[1].reshape((self.batch_size,))

    def _open(self):
        try:
            return LMDBReader(self.param.data_param.source, 'LMDB (data_param.source)')
        except CaffeError as exc:
            raise self.error(str(exc)) from None

    def make_reader(self, rng=None):
        return DatumReader(self, self.sample_shape, self._open(), rng)


class ImageListReader(TransformedReader):
    """Images named by a list file, in order (reshuffled every pass with ``shuffle``)."""

    def __init__(self, layer, entries, shape, rng=None):
        super().__init__(layer, shape, len(layer.param.top) > 1, rng)
        p = layer.param.image_data_param
        self.entries, self.param = entries, p
        self.order = np.arange(len(entries))
        if p.shuffle:
            self.rng.shuffle(self.order)
        self.position = self.rng.randint(p.rand_skip) % len(entries) if p.rand_skip else 0

    def read(self, n):
        images, labels = [], []
        for _ in range(n):
            path, label = self.entries[self.order[self.position]]
            images.append(load_list_image(path, self.param))
            labels.append(label)
            self._advance()
        return images, labels

    def pass_over(self, n):
        for _ in range(n):
            self._advance()

    def _advance(self):
        self.position += 1
        if self.position == len(self.entries):
            self.position = 0
            if self.param.shuffle:
                self.rng.shuffle(self.order)


def load_list_image(path, p):
    return hwc_to_chw(read_image(listed(path, p.source), p.is_color, p.new_height, p.new_width))


@register('ImageData')
class ImageDataListLayer(ImageDataLayer):
    """Caffe's ImageData: "<file> <label>" lines, files under image_data_param.root_folder."""

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.check_tops(top, minimum=1, maximum=2)
        p = self.param.image_data_param
        if (p.new_height > 0) != (p.new_width > 0):
            raise self.error('image_data_param: give both new_height and new_width, or neither')
        self.batch_size = self.check_batch_size(p.batch_size, 'image_data_param.batch_size')
        self.entries = [(p.root_folder + name, label)
                        for name, label in read_image_list(p.source, self.error)]
        try:
            self.sample_shape = load_list_image(self.entries[0][0], p).shape
        except CaffeError as exc:
            raise self.error(str(exc)) from None
        transformer = DataTransformer(self.param.transform_param, self.phase, None, self.error)
        top[0].reshape((self.batch_size,) + transformer.output_shape(*self.sample_shape))
        if len(top) > 1:
            top[1].reshape((self.batch_size,))

    def make_reader(self, rng=None):
        return ImageListReader(self, self.entries, self.sample_shape, rng)


class MemoryReader:
    """Cycles through the arrays last given to the layer's set_input_arrays()."""

    def skip(self, n):
        self.next_batch(n)

    def __init__(self, layer):
        self.layer = layer
        self.version, self.position = None, 0

    def next_batch(self, n):
        layer = self.layer
        if layer.arrays is None:
            raise layer.error('no data: call set_input_arrays(data, labels) before forward')
        if self.version != layer.version:          # new arrays start from their first row
            self.version, self.position = layer.version, 0
        data, labels = layer.arrays
        rows = (self.position + np.arange(n)) % len(data)
        self.position = (self.position + n) % len(data)
        return [data[rows], labels[rows]][:len(layer.param.top)]


@register('MemoryData')
class MemoryDataLayer(ImageDataLayer):
    """Caffe's MemoryData: batches of the arrays passed to ``set_input_arrays`` (pycaffe's
    ``net.set_input_arrays``), batch_size rows at a time, wrapping around."""

    prefetch = False

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.check_tops(top, minimum=1, maximum=2)
        p = self.param.memory_data_param
        self.batch_size = self.check_batch_size(p.batch_size, 'memory_data_param.batch_size')
        self.sample_shape = (p.channels, p.height, p.width)
        if min(self.sample_shape) <= 0:
            raise self.error('memory_data_param needs channels, height and width > 0, got %s'
                             % (list(self.sample_shape),))
        self.arrays, self.version = None, 0
        top[0].reshape((self.batch_size,) + self.sample_shape)
        if len(top) > 1:
            top[1].reshape((self.batch_size,))

    def set_input_arrays(self, data, labels):
        """data: N x channels x height x width; labels: N or N x 1 x 1 x 1; N a multiple of
        batch_size (Caffe's rule). The next forward starts at row 0."""
        data, labels = np.asarray(data), np.asarray(labels)
        if data.ndim != 4 or data.shape[1:] != self.sample_shape:
            raise self.error('set_input_arrays: data must be N x %s, got shape %s'
                             % (' x '.join(map(str, self.sample_shape)), data.shape))
        if labels.size != data.shape[0] or labels.ndim not in (1, 4):
            raise self.error('set_input_arrays: labels must be (%d,) or (%d, 1, 1, 1), got %s'
                             % (data.shape[0], data.shape[0], labels.shape))
        if data.shape[0] == 0 or data.shape[0] % self.batch_size:
            raise self.error('set_input_arrays: the number of rows (%d) must be a positive '
                             'multiple of batch_size %d' % (data.shape[0], self.batch_size))
        self.arrays = (data.astype(self.dtype), labels.reshape(-1).astype(self.dtype))
        self.version += 1

    def make_reader(self, rng=None):
        return MemoryReader(self)
