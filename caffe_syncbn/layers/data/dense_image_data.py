"""DenseImageData, the data layer of SegNet's and ENet's Caffe: image / label-image pairs
read and cut as data/dense_image.py says, tops data (N x C x h x w) and label
(N x 1 x h' x w')."""
import copy

import numpy as np

from ... import caffe_pb2
from ...data.datum import hwc_to_chw
from ...data.dense_image import check_dense_param, dense_window, read_dense_pair
from ...data.segmentation import read_pair_list
from ...data.transform import DataTransformer
from ...errors import quote
from ...layer import register
from .image_data import ImageDataLayer, SampleStream


def label_transform(param):
    """transform_param as it applies to a label image: its crop and flip, no mean or scale."""
    return caffe_pb2.TransformationParameter(crop_size=param.crop_size, mirror=param.mirror)


class DenseReader(SampleStream):
    """The listed pairs in order (reshuffled every pass with ``shuffle``), from a random
    start within rand_skip."""

    def __init__(self, layer, rng=None):
        self.layer = layer
        self.rng = layer.reader_rng(rng)
        tp, error = layer.param.transform_param, layer.error
        self.images = DataTransformer(tp, layer.phase, self.rng, error)
        self.labels = DataTransformer(label_transform(tp), layer.phase, self.rng, error)
        self.start_stream(self.rng)
        p = layer.dense
        self.order = np.arange(len(layer.pairs))
        if p.shuffle:
            self.rng.shuffle(self.order)
        self.position = self.rng.randint(p.rand_skip) % len(self.order) if p.rand_skip else 0

    def next_batch(self, n):
        layer = self.layer
        rngs = self.sample_rngs(n)
        images, labels = [], []
        for rng in rngs:
            image, label_map = layer.read_pair(*layer.pairs[self.order[self.position]])
            image, label_map = dense_window(image, label_map, layer.dense, rng, layer.error)
            images.append(hwc_to_chw(image))
            labels.append(label_map[None])
            self.pass_over(1)
        if not n:
            h, w = layer.window
            return [np.zeros((0, layer.channels, h, w), layer.dtype),
                    np.zeros((0, 1) + layer.label_window, layer.dtype)]
        # the label's crop and flip are the image's: the same draws, from copies
        label_rngs = [copy.deepcopy(rng) for rng in rngs]
        return [self.images(images, layer.dtype, rngs),
                self.labels(labels, layer.dtype, label_rngs)]

    def pass_over(self, n):
        for _ in range(n):
            self.position += 1
            if self.position == len(self.order):
                self.position = 0
                if self.layer.dense.shuffle:
                    self.rng.shuffle(self.order)


@register('DenseImageData')
class DenseImageDataLayer(ImageDataLayer):
    """SegNet's and ENet's DenseImageData (data/dense_image.py): dense_image_data_param's
    source, root_folder, batch_size, shuffle, rand_skip, new_height/new_width, is_color,
    mirror, crop_height/crop_width and ENet's label_divide_factor, then transform_param."""

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.check_tops(top, exact=2)
        p = self.dense = self.param.dense_image_data_param
        check_dense_param(p, self.error)
        self.batch_size = self.check_batch_size(p.batch_size, 'dense_image_data_param.batch_size')
        self.pairs = read_pair_list(p.source, p.root_folder, self.error)
        image, label_map = self.read_pair(*self.pairs[0])
        crop = self.param.transform_param.crop_size
        self.channels = image.shape[2] if image.ndim == 3 else 1
        if crop:
            self.window = self.label_window = (crop, crop)
        elif p.crop_height:
            self.window = self.label_window = (p.crop_height, p.crop_width)
        else:
            self.window, self.label_window = image.shape[:2], label_map.shape
        top[0].reshape((self.batch_size, self.channels) + tuple(self.window))
        top[1].reshape((self.batch_size, 1) + tuple(self.label_window))

    def read_pair(self, image_path, label_path):
        """One pair as the fork reads it; a label image of another size than its image is
        refused unless label_divide_factor made it so."""
        image, label_map = read_dense_pair(image_path, label_path, self.dense, self.error)
        if self.dense.label_divide_factor == 1 and label_map.shape != image.shape[:2]:
            raise self.error('image %s is %d x %d but its label image %s is %d x %d (paired in '
                             '%s)' % ((quote(image_path),) + image.shape[:2] + (quote(label_path),)
                                      + label_map.shape + (self.dense.source,)))
        return image, label_map

    def make_reader(self, rng=None):
        return DenseReader(self, rng)

