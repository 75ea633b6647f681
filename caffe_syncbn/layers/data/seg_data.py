"""SegData (ImageSegData): the segmentation forks' image and label-map pairs, a list of
them read as ImageData reads its images (image_data.py), each pair cropped, scaled and
mirrored together (data/segmentation.py, which says where DeepLab's ImageSegData differs
from yjxiong's SegData)."""
import numpy as np

from ...data.segmentation import SegTransformer, read_pair, read_pair_list, read_seg_lines
from ...layer import register
from .image_data import ImageDataLayer, SampleStream


class SegReader(SampleStream):
    """Image / label-map pairs in list order (reshuffled every pass with ``shuffle``)."""

    def __init__(self, layer, rng=None):
        self.layer = layer
        self.rng = layer.reader_rng(rng)
        self.transformer = layer.transformer(self.rng)
        self.start_stream(self.rng)
        self.order = np.arange(len(layer.pairs))
        if layer.shuffle:
            self.rng.shuffle(self.order)
        self.position = 0

    def next_batch(self, n):
        return self.next_batches([n])[0]

    def next_batches(self, sizes):
        """One batch per entry of ``sizes`` (see parallel.read_parts): whole images may differ
        in size from one batch to the next, not within one."""
        layer = self.layer
        pairs = [self._next_pair() for _ in range(sum(sizes))]
        batches = self.transformer.batches(pairs, sizes, layer.dtype, balance=layer.balance,
                                           rngs=self.sample_rngs(len(pairs)))
        out, start = [], 0
        for size, batch in zip(sizes, batches):
            if batch is None:
                h, w = layer.window
                batch = (np.zeros((0, layer.channels, h, w), layer.dtype),
                         np.zeros((0, 1, h, w), layer.dtype))
            data, labels = batch
            # DeepLab's data_dim: the part of each window the image covers (the rest is padding)
            covered = [pair[0].shape[:2] for pair in pairs[start:start + size]]
            dims = np.minimum(np.reshape(covered, (size, 2)), data.shape[2:]).astype(layer.dtype)
            out.append([data, labels, dims.reshape(size, 1, 1, 2)][:len(layer.param.top)])
            start += size
        return out

    def _next_pair(self):
        layer = self.layer
        pair = layer.read_pair(*layer.pairs[self.order[self.position]])
        self._advance()
        return pair

    def pass_over(self, n):
        for _ in range(n):
            self._advance()

    def _advance(self):
        self.position += 1
        if self.position == len(self.order):
            self.position = 0
            if self.layer.shuffle:
                self.rng.shuffle(self.order)


@register('SegData', 'ImageSegData')
class SegDataLayer(ImageDataLayer):
    """Tops data (N x C x h x w), label (N x 1 x h x w) and, optionally, DeepLab's data_dim
    (N x 1 x 1 x 2: the height and width of each window that the image covers).

    SegData (yjxiong) reads seg_data_param: source, root_dir, shuffle, balance.
    ImageSegData (DeepLab) reads image_data_param: source, root_folder, shuffle, batch_size,
    new_height/new_width, is_color, ignore_label and label_type.
    The batch size comes from image_data_param.batch_size, else data_param.batch_size,
    else 1 (yjxiong's layer reads one pair per batch).
    """

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.check_tops(top, minimum=2, maximum=3)
        self.deeplab = self.type == 'ImageSegData'
        p = self.param.image_data_param
        if not self.deeplab:
            q = self.param.seg_data_param
            source, prefix, self.shuffle, self.balance = q.source, q.root_dir, q.shuffle, q.balance
            self.pairs = read_pair_list(source, prefix, self.error)
        else:
            source, self.shuffle, self.balance = p.source, p.shuffle, False
            if (p.new_height > 0) != (p.new_width > 0):
                raise self.error('image_data_param: give both new_height and new_width, or '
                                 'neither')
            self.pairs = read_seg_lines(source, p.root_folder, p.label_type,
                                        p.HasField('label_type'), self.error)
        self.color = p.is_color if self.deeplab else True
        self.size = (p.new_height, p.new_width) if self.deeplab else (0, 0)
        self.ignore_label = p.ignore_label
        for field, param in (('image_data_param', self.param.image_data_param),
                             ('data_param', self.param.data_param)):
            if self.param.HasField(field) and param.HasField('batch_size'):
                self.batch_size = self.check_batch_size(param.batch_size, field + '.batch_size')
                break
        else:
            self.batch_size = 1
        self.source = source
        image, _ = self.read_pair(*self.pairs[0])
        transformer = self.transformer(None)
        self.channels = image.shape[2] if image.ndim == 3 else 1
        self.window = transformer.output_size(*image.shape[:2])
        top[0].reshape((self.batch_size, self.channels) + self.window)
        top[1].reshape((self.batch_size, 1) + self.window)
        if len(top) > 2:
            top[2].reshape((self.batch_size, 1, 1, 2))

    def error(self, message):
        # the ImageSegData read here is DeepLab's: say so, as other forks have their own
        if self.type == 'ImageSegData':
            message = "as DeepLab's ImageSegData (deeplab-public-ver2): " + message
        return super().error(message)

    def transformer(self, rng):
        return SegTransformer(self.param.transform_param, self.phase, rng, self.ignore_label,
                              self.error, self.deeplab)

    def read_pair(self, image_path, label):
        return read_pair(image_path, label, self.color, self.error, self.source, self.size,
                         self.ignore_label)

    def make_reader(self, rng=None):
        return SegReader(self, rng)
