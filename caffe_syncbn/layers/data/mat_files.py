"""DeepLab's MatWrite and MatRead: blobs to and from MATLAB .mat files
(formats/mat.py), named <prefix><name>_blob_<i>.mat. The names are the first words of the
lines of mat_*_param.source, less ``strip`` characters at their end (DeepLab's test lists
of image ids), or iter_<k> without a source. DeepLab's test nets write their scores so,
for its densecrf tool and its MATLAB evaluation."""
import os

from ...backend import to_numpy
from ...errors import quote
from ...formats.mat import read_blob_mat, write_blob_mat
from ...formats.regular import require_regular
from ...layer import Layer, register


def source_names(layer, p):
    """The names listed in ``p.source`` (a MatWriteParameter or MatReadParameter)."""
    if p.strip < 0:
        raise layer.error('strip must be >= 0, got %d' % p.strip)
    require_regular(p.source, 'source list', layer.error)
    try:
        with open(p.source, errors='surrogateescape') as f:
            words = [line.split()[0] for line in f if line.split()]
    except OSError as exc:
        raise layer.error('cannot read source %s: %s' % (quote(p.source), exc.strerror)) from None
    short = [word for word in words if len(word) <= p.strip]
    if short:
        raise layer.error('strip %d leaves nothing of %s, listed in %s'
                          % (p.strip, quote(short[0]), p.source))
    return [word[:len(word) - p.strip] for word in words]


def mat_path(prefix, name, index):
    return '%s%s_blob_%d.mat' % (prefix, name, index)


@register('MatWrite')
class MatWriteLayer(Layer):
    """Each bottom, every ``period`` forwards (counted from the first), to a .mat file;
    k forwards in, the name is the source's k-th, or iter_<k>. No tops, no gradient."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=1)
        self.check_tops(top, exact=0)
        p = self.param.mat_write_param
        if not p.prefix:
            raise self.error('mat_write_param.prefix is required (the files are '
                             '<prefix><name>_blob_<i>.mat)')
        if p.period <= 0:
            raise self.error('mat_write_param.period must be > 0, got %d' % p.period)
        self.names = source_names(self, p) if p.source else None
        self.iteration = 0

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        p = self.param.mat_write_param
        k, self.iteration = self.iteration, self.iteration + 1
        if k % p.period:
            return
        if self.names is not None and k >= len(self.names):
            raise self.error('forward %d, but source %s names %d files: the net ran more '
                             'iterations than the list has images' % (k + 1, p.source,
                                                                      len(self.names)))
        name = self.names[k] if self.names is not None else 'iter_%d' % k
        folder = os.path.dirname(os.path.abspath(mat_path(p.prefix, name, 0)))
        if not os.path.isdir(folder):
            raise self.error('the folder of %s does not exist' % quote(mat_path(p.prefix, name, 0)))
        for i, blob in enumerate(bottom):
            write_blob_mat(mat_path(p.prefix, name, i), to_numpy(blob.data))

    def allow_force_backward(self, bottom_index):
        return False


@register('MatRead')
class MatReadLayer(Layer):
    """Each top from the .mat files MatWrite wrote, batch_size of them per forward (one
    blob of N = 1 each), cycling through the source's names (or iter_<k>, not cycling)."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=0)
        self.check_tops(top, minimum=1)
        p = self.param.mat_read_param
        if not p.prefix:
            raise self.error('mat_read_param.prefix is required (the files are '
                             '<prefix><name>_blob_<i>.mat)')
        if p.batch_size <= 0:
            raise self.error('mat_read_param.batch_size must be > 0, got %d' % p.batch_size)
        self.names = source_names(self, p) if p.source else None
        if self.names == []:
            raise self.error('source %s names no files' % quote(p.source))
        self.iteration = 0
        first = self.names[0] if self.names is not None else 'iter_0'
        for i, blob in enumerate(top):
            blob.reshape((p.batch_size,) + self._read(first, i).shape[1:])

    def _read(self, name, index):
        blob = read_blob_mat(mat_path(self.param.mat_read_param.prefix, name, index),
                             self.error)
        if blob.shape[0] != 1:
            raise self.error('%s holds %d items (MATLAB size(data, 4)); MatRead reads one per '
                             'file' % (mat_path(self.param.mat_read_param.prefix, name, index),
                                       blob.shape[0]))
        return blob

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        for n in range(self.param.mat_read_param.batch_size):
            if self.names is not None:
                self.iteration %= len(self.names)
                name = self.names[self.iteration]
            else:
                name = 'iter_%d' % self.iteration
            for i, blob in enumerate(top):
                item = self._read(name, i)
                if item.shape[1:] != blob.shape[1:]:
                    raise self.error('%s holds a blob of %s, the first file %s'
                                     % (mat_path(self.param.mat_read_param.prefix, name, i),
                                        list(item.shape[1:]), list(blob.shape[1:])))
                blob.data[n] = self.xp.asarray(item[0], dtype=self.dtype)
            self.iteration += 1

