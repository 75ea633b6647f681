"""Caffe's DataTransformer: what transform_param does to a batch of images.

For every image, as in Caffe: pick a crop (random in TRAIN, centred at
((H - crop) // 2, (W - crop) // 2) in TEST), flip it left-right at random when ``mirror``
is set, then compute ``(pixel - mean) * scale`` with the mean of the same (unflipped)
source position (mean_file) or of the channel (mean_value). The whole batch is done with
one gather, whatever crops and flips its images drew.

The draws come from ``rng`` for the whole batch, or, given ``rngs`` (one generator per
image, as the data readers give), each image's from its own: then a sample's crop and
flip do not depend on which other samples share its batch, or which process reads them.
"""
import os

import numpy as np

from ..caffe_pb2 import TRAIN
from ..errors import CaffeError, quote
from ..formats.blobs import read_blob_proto
from ..formats.regular import require_regular


class DataTransformer:
    """Applies a TransformationParameter; random choices come from ``rng`` (RandomState)."""

    def __init__(self, param, phase, rng, error=CaffeError):
        self.error = error
        self.phase = phase
        self.rng = rng
        self.scale = float(param.scale)
        self.mirror = bool(param.mirror)
        self.crop_size = int(param.crop_size)
        if param.force_color and param.force_gray:
            raise error('transform_param: force_color and force_gray cannot both be set')
        #: how encoded images are decoded: True colour, False gray, None as stored
        self.color = True if param.force_color else (False if param.force_gray else None)
        self.mean_values = np.asarray(param.mean_value, np.float64)
        self.mean_image = None
        if param.mean_file:
            if len(self.mean_values):
                raise error('transform_param: give mean_file or mean_value, not both')
            self.mean_image = load_mean_file(param.mean_file, error)

    def output_shape(self, channels, height, width):
        """(C, H, W) of a transformed image with the given input size; checks the means."""
        self._check(channels, height, width)
        if self.crop_size:
            return channels, self.crop_size, self.crop_size
        return channels, height, width

    def _draws(self, n, spare_h, spare_w, rngs):
        """The crops' top and left, and the flips, of n images with that much room to spare."""
        random_crop = self.crop_size and self.phase == TRAIN
        if rngs is None:              # the batch's draws, one call per field
            top = self.rng.randint(0, spare_h + 1, size=n) if random_crop else None
            left = self.rng.randint(0, spare_w + 1, size=n) if random_crop else None
            flip = self.rng.randint(0, 2, size=n) if self.mirror else np.zeros(n, int)
        else:
            top = [r.randint(0, spare_h + 1) for r in rngs] if random_crop else None
            left = [r.randint(0, spare_w + 1) for r in rngs] if random_crop else None
            flip = [r.randint(0, 2) if self.mirror else 0 for r in rngs]
        if not random_crop:
            top, left = np.full(n, spare_h // 2), np.full(n, spare_w // 2)
        return np.asarray(top, np.int64), np.asarray(left, np.int64), np.asarray(flip, bool)

    def _check(self, channels, height, width):
        if len(self.mean_values) not in (0, 1, channels):
            raise self.error('transform_param: give 1 mean_value or one per channel (%d), got %d'
                             % (channels, len(self.mean_values)))
        if self.mean_image is not None and self.mean_image.shape != (channels, height, width):
            raise self.error('mean_file has shape %s but the images are %s'
                             % (list(self.mean_image.shape), [channels, height, width]))
        if self.crop_size and (height < self.crop_size or width < self.crop_size):
            raise self.error('crop_size %d is larger than an image of %d x %d'
                             % (self.crop_size, height, width))

    def __call__(self, images, dtype=np.float32, rngs=None):
        """Transform a list of C x H x W arrays (or an N x C x H x W array) into one
        N x C x h x w array of ``dtype``. Images of different sizes need crop_size.
        ``rngs``: one generator per image for its random crop and flip (else ``rng``)."""
        dtype = np.dtype(dtype)
        if isinstance(images, np.ndarray) and images.ndim == 4:
            return self._transform_stack(images, dtype, rngs)
        shapes = {image.shape for image in images}
        if len(shapes) == 1:
            return self._transform_stack(np.stack(images), dtype, rngs)
        if not self.crop_size:
            raise self.error('images of different sizes %s in one batch need crop_size'
                             % sorted(shapes))
        out = None
        for shape in sorted(shapes):         # one gather per group of equal-sized images
            rows = [i for i, image in enumerate(images) if image.shape == shape]
            part = self._transform_stack(np.stack([images[i] for i in rows]), dtype,
                                         None if rngs is None else [rngs[i] for i in rows])
            if out is None:
                out = np.empty((len(images),) + part.shape[1:], dtype)
            out[rows] = part
        return out

    def _transform_stack(self, batch, dtype, rngs=None):
        n, channels, height, width = batch.shape
        self._check(channels, height, width)
        crop_h, crop_w = (self.crop_size, self.crop_size) if self.crop_size else (height, width)
        top, left, flip = self._draws(n, height - crop_h, width - crop_w, rngs)
        rows = top[:, None] + np.arange(crop_h)                    # (n, crop_h)
        cols = left[:, None] + np.arange(crop_w)                   # (n, crop_w)
        cols = np.where(flip[:, None], cols[:, ::-1], cols)
        plain = crop_h == height and crop_w == width and not flip.any()
        chan = np.arange(channels)[None, :, None, None]
        rows4, cols4 = rows[:, None, :, None], cols[:, None, None, :]
        out = batch if plain else batch[np.arange(n)[:, None, None, None], chan, rows4, cols4]
        out = out.astype(dtype)
        if self.mean_image is not None:
            mean = self.mean_image.astype(dtype)
            out -= mean[None] if plain else mean[chan, rows4, cols4]
        elif len(self.mean_values):
            out -= np.broadcast_to(self.mean_values.astype(dtype), (channels,))[:, None, None]
        out *= dtype.type(self.scale)
        return out


def load_mean_file(path, error=CaffeError):
    """The C x H x W mean image stored in a .binaryproto (Caffe's legacy 1 x C x H x W)."""
    if not os.path.exists(path):
        raise error('mean_file %s not found' % quote(path))
    require_regular(path, 'mean_file', error)
    mean = read_blob_proto(path)
    if mean.ndim == 4 and mean.shape[0] == 1:
        mean = mean[0]
    if mean.ndim != 3:
        raise error('mean_file %s holds a blob of shape %s, expected 1 x C x H x W'
                    % (path, list(mean.shape)))
    return mean
