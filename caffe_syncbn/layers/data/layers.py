"""Layers that bring data into the net: the DataLayer contract, Input, DummyData, HDF5Data,
and HDF5Output, which writes its bottoms out.

The DataLayer contract (Data, ImageData, SegData and the input pipeline build on it):
  ``batch_size``      rows of one batch of this net (set in setup)
  ``make_reader(rng=None)``  a new reader (its random draws from ``rng`` when given)
                      whose ``next_batch(n)`` returns host numpy arrays, one per top, each
                      with first axis n; one reader can serve the global batch of all
                      replicas of a data-parallel run; ``skip(n)`` passes over n samples
                      without decoding them (a process reads only its share); a reader may
                      also have ``next_batches(sizes)``: one batch per replica, whose shapes
                      may differ (parallel.read_parts)
  forward             with ``ctx.feeder`` set, the tops are ``ctx.feeder(self)``: this
                      replica's slice of the global batch (it may have 0 rows); otherwise the
                      next batch of the layer's own reader. Tops take each batch's shape.

DummyData is not a DataLayer: it has no batches to split, so every replica fills its own tops.
"""
import os

import numpy as np

from ... import caffe_pb2
from ...backend import to_numpy
from ...data.datum import listed
from ...errors import name_list, quote
from ...fillers import fill
from ...formats.hdf5 import other_files_refusal, read_dataset, reading, writing
from ...formats.regular import require_regular
from ...layer import Layer, register


class DataLayer(Layer):
    """Base of the layers that produce batches; subclasses set ``batch_size`` in setup."""

    batch_size = 0

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=0)
        self.check_tops(top, minimum=1)
        self._reader = None

    def make_reader(self, rng=None):
        raise NotImplementedError

    def reshape(self, bottom, top):
        pass        # the tops take the shape of each batch in forward

    def forward(self, bottom, top):
        if self.ctx.feeder is not None:
            self.set_tops(top, self.ctx.feeder(self))
        else:
            if self._reader is None:
                self._reader = self.make_reader()
            self.set_tops(top, self._reader.next_batch(self.batch_size))

    def set_tops(self, top, arrays):
        if len(arrays) != len(top):
            raise self.error('expected %d arrays for its %d tops, got %d'
                             % (len(top), len(top), len(arrays)))
        for blob, array in zip(top, arrays):
            blob.reshape(array.shape)
            blob.data[...] = self.xp.asarray(array, dtype=self.dtype)


@register('Input')
class InputLayer(DataLayer):
    """Tops shaped by input_param (one shape for all tops, or one each); the caller fills them."""

    def setup(self, bottom, top):
        super().setup(bottom, top)
        shapes = self.param.input_param.shape
        if len(shapes) not in (0, 1, len(top)):
            raise self.error('input_param needs 1 shape or one per top (%d), got %d'
                             % (len(top), len(shapes)))
        for i, blob in enumerate(top):
            if len(shapes):
                blob.reshape(tuple(shapes[i if len(shapes) > 1 else 0].dim))
        self.batch_size = top[0].shape[0] if top[0].shape else 1

    def make_reader(self, rng=None):
        raise self.error('an Input layer has no reader: its tops are set by the caller '
                         '(net.blobs[name].data, or net.forward(name=array))')

    def forward(self, bottom, top):
        if self.ctx.feeder is not None:
            self.set_tops(top, self.ctx.feeder(self))


@register('DummyData')
class DummyDataLayer(Layer):
    """Tops filled by data_filler (0 = zeros, 1 for all tops, or one each); random fillers
    are drawn again on every forward, constant ones once."""

    tops_persist = True

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=0)
        self.check_tops(top, minimum=1)
        p = self.param.dummy_data_param
        n = len(top)
        if len(p.data_filler) not in (0, 1, n):
            raise self.error('needs 0, 1 or %d data_filler, got %d' % (n, len(p.data_filler)))
        fillers = list(p.data_filler) or [caffe_pb2.FillerParameter(type='constant', value=0)]
        self.fillers = [fillers[i if len(fillers) > 1 else 0] for i in range(n)]
        for i, (blob, filler) in enumerate(zip(top, self.fillers)):
            blob.reshape(self._top_shape(p, i, n))
            if filler.type == 'constant':
                fill(filler, blob)

    def _top_shape(self, p, i, n):
        legacy = [p.num, p.channels, p.height, p.width]
        if any(len(values) for values in legacy):
            if len(p.shape):
                raise self.error('give either shape or the legacy num/channels/height/width')
            for name, values in zip(('num', 'channels', 'height', 'width'), legacy):
                if len(values) not in (1, n):
                    raise self.error('needs 1 or %d values of %s, got %d' % (n, name, len(values)))
            return tuple(values[i if len(values) > 1 else 0] for values in legacy)
        if len(p.shape) not in (1, n):
            raise self.error('needs 1 or %d shapes, got %d' % (n, len(p.shape)))
        return tuple(p.shape[i if len(p.shape) > 1 else 0].dim)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        for blob, filler in zip(top, self.fillers):
            if filler.type != 'constant':
                fill(filler, blob)


class HDF5Reader:
    """Rows of the .h5 files a list file names, in order; batches run across file ends and
    wrap around to the first file. With ``shuffle`` the file order is reshuffled on every
    wrap and the rows of a file every time it is entered, as Caffe does."""

    def __init__(self, source, datasets, dtype, shuffle=False, rng=None, error=ValueError):
        self.error, self.source = error, source
        require_regular(source, 'HDF5 file list', error)
        try:
            with open(source, errors='surrogateescape') as f:    # names in any encoding
                self.files = f.read().split()
        except OSError as exc:
            raise error('cannot read the HDF5 file list %s: %s'
                        % (quote(source), exc.strerror)) from None
        if not self.files:
            raise error('the HDF5 file list %s names no files' % quote(source))
        self.datasets, self.dtype = list(datasets), dtype
        self.shuffle, self.rng = shuffle, rng if rng is not None else np.random.RandomState()
        self.file_order = np.arange(len(self.files))
        if shuffle:
            self.rng.shuffle(self.file_order)
        self.position = 0
        self.row_shapes = None         # of the first file; every file must have them
        self._load()

    def _load(self):
        import h5py
        name = listed(self.files[self.file_order[self.position]], self.source, self.error)
        where = quote(name)
        with reading(where, 'HDF5 data file', self.error), h5py.File(name, 'r') as f:
            refused = other_files_refusal(f, where)
            missing = [] if refused else [d for d in self.datasets if d not in f]
            present = list(f)
            if not refused and not missing:
                self.arrays = [np.asarray(read_dataset(f[d], '%s: dataset %s' % (where, quote(d))),
                                          self.dtype) for d in self.datasets]
        if refused:           # raised outside, where reading() would not wrap them again
            raise self.error(refused)
        if missing:
            raise self.error('%s has no dataset %s (it has: %s)'
                             % (where, name_list(missing), name_list(present)))
        rows = {a.shape[0] if a.ndim else 0 for a in self.arrays}
        if len(rows) != 1 or 0 in rows:
            raise self.error('%s: datasets %s must have the same number (> 0) of rows, got %s'
                             % (where, self.datasets, [a.shape for a in self.arrays]))
        shapes = [a.shape[1:] for a in self.arrays]
        if self.row_shapes is None:
            self.row_shapes = shapes
        elif shapes != self.row_shapes:
            raise self.error('%s: datasets %s have rows of shapes %s, the first file\'s %s'
                             % (where, self.datasets, shapes, self.row_shapes))
        self.row_order = np.arange(rows.pop())
        if self.shuffle:
            self.rng.shuffle(self.row_order)
        self.row = 0

    def _advance(self):
        if len(self.files) > 1:
            self.position += 1
            if self.position == len(self.files):
                self.position = 0
                if self.shuffle:
                    self.rng.shuffle(self.file_order)
            self._load()
        else:
            self.row = 0
            if self.shuffle:
                self.rng.shuffle(self.row_order)

    def next_batch(self, n):
        chunks = [[np.empty((0,) + a.shape[1:], self.dtype)] for a in self.arrays]
        self._walk(n, lambda rows: [chunk.append(array[rows])
                                    for chunk, array in zip(chunks, self.arrays)])
        return [np.concatenate(chunk) for chunk in chunks]

    def skip(self, n):
        """Pass over n rows without copying them (a process reads only its share)."""
        self._walk(n, lambda rows: None)

    def _walk(self, n, take_rows):
        while n > 0:
            take = min(n, len(self.row_order) - self.row)
            take_rows(self.row_order[self.row:self.row + take])
            self.row += take
            n -= take
            if self.row == len(self.row_order):
                self._advance()


@register('HDF5Data')
class HDF5DataLayer(DataLayer):
    """Tops named after datasets of the .h5 files listed in hdf5_data_param.source."""

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.batch_size = self.param.hdf5_data_param.batch_size
        if self.batch_size <= 0:
            raise self.error('hdf5_data_param.batch_size must be > 0')
        self._reader = self.make_reader()
        for blob, shape in zip(top, self._reader.row_shapes):
            blob.reshape((self.batch_size,) + tuple(shape))

    def make_reader(self, rng=None):
        p = self.param.hdf5_data_param
        return HDF5Reader(p.source, self.param.top, self.dtype, p.shuffle,
                          rng if rng is not None else self.ctx.rng, self.error)


@register('HDF5Output')
class HDF5OutputLayer(Layer):
    """Writes bottoms 0 and 1 as datasets 'data' and 'label' (legacy 4-D shapes, as Caffe)
    to hdf5_output_param.file_name; each forward atomically replaces the file with its batch."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, exact=0)
        self.file_name = self.param.hdf5_output_param.file_name
        if not self.file_name:
            raise self.error('hdf5_output_param.file_name is required')

    def reshape(self, bottom, top):
        for blob in bottom:
            if blob.num_axes > 4:
                raise self.error('writes legacy 4-D datasets, got a bottom of shape %s'
                                 % (blob.shape,))
        if bottom[0].shape[:1] != bottom[1].shape[:1]:
            raise self.error('data and label need the same number of rows, got shapes %s and %s'
                             % (bottom[0].shape, bottom[1].shape))

    def forward(self, bottom, top):
        folder = os.path.dirname(os.path.abspath(self.file_name))
        if not os.path.isdir(folder):
            raise self.error('the folder of %s does not exist' % quote(self.file_name))
        with writing(self.file_name) as f:
            for name, blob in zip(('data', 'label'), bottom):
                shape = tuple(blob.shape) + (1,) * (4 - blob.num_axes)
                f.create_dataset(name, data=to_numpy(blob.data).reshape(shape))
