"""Image / label-map pairs for semantic segmentation: yjxiong's SegData, DeepLab's ImageSegData.

Per pair, in TRAIN: rescale both by a random factor (bilinear for the image, nearest for
the labels), take a random crop_size x crop_size window, padding at the bottom and right
where the image is smaller (the image with its mean, which is 0 after subtraction, the
labels with ignore_label, as DeepLab does), and flip both left-right at random when
``mirror`` is set. In TEST the window is centred and nothing is random. The image becomes
``(pixel - mean_value[c]) * scale``. Without crop_size the whole (rescaled) image is kept,
trimmed to a multiple of transform_param.stride as yjxiong's layer does.

DeepLab's ImageSegData (``deeplab=True``) differs where DeepLab's code does: the factor is
one of scale_factors, drawn with equal chances, and the rescaled size is truncated
(int(H * factor)); the window may be crop_height x crop_width; the flip is drawn in every
phase when ``mirror`` is set; the pad label is image_data_param.ignore_label. Its list
lines (``read_seg_lines``) name a label image (label_type PIXEL), one class for the whole
image (IMAGE) or nothing (NONE: every pixel is ignore_label); new_height/new_width resize
the image and the label image alike, bilinearly, as DeepLab reads both.
"""
import numpy as np

from ..caffe_pb2 import TRAIN, ImageDataParameter
from ..errors import CaffeError, quote
from ..formats.regular import require_regular
from .datum import cv2, hwc_to_chw, imread, listed, read_image, resize

IGNORE_LABEL = 255


def read_pair_list(path, prefix='', error=CaffeError):
    """[(image path, label path)] from a list file of "image label" lines. The prefix is
    prepended as plain text, as Caffe does (so a root folder needs its trailing '/')."""
    require_regular(path, 'list file', error)
    try:
        with open(path, errors='surrogateescape') as f:     # file names in any encoding
            words = f.read().split()
    except OSError as exc:
        raise error('cannot read list file %s: %s' % (quote(path), exc.strerror)) from None
    if not words:
        raise error('list file %s names no images' % quote(path))
    if len(words) % 2:
        raise error('list file %s: expected "image label" pairs, got an odd number (%d) of '
                    'names' % (path, len(words)))
    return [(prefix + words[i], prefix + words[i + 1]) for i in range(0, len(words), 2)]


def read_seg_lines(path, prefix, label_type, explicit=True, error=CaffeError):
    """[(image path, label)] of DeepLab's list file: label is a label image's path
    (label_type PIXEL), a class (IMAGE) or None (NONE: lines name images alone). The
    prefix is prepended to paths as plain text. Where label_type is not ``explicit``
    (DeepLab's default, IMAGE), a second word that is no number names a label image."""
    require_regular(path, 'list file', error)
    try:
        with open(path, errors='surrogateescape') as f:     # file names in any encoding
            lines = [(number, line.split()) for number, line in enumerate(f, 1) if line.split()]
    except OSError as exc:
        raise error('cannot read list file %s: %s' % (quote(path), exc.strerror)) from None
    if not lines:
        raise error('list file %s names no images' % quote(path))
    kinds = ImageDataParameter.LabelType
    entries = []
    for number, words in lines:
        if label_type == ImageDataParameter.NONE:
            entries.append((prefix + words[0], None))
            continue
        if len(words) < 2:
            raise error('%s:%d: label_type %s needs a second word (the %s), got %s'
                        % (path, number, kinds.Name(label_type), 'label image' if
                           label_type == ImageDataParameter.PIXEL else 'class', quote(words[0])))
        label = words[1]
        if label_type == ImageDataParameter.IMAGE and (explicit or _is_class(label)):
            if not _is_class(label):
                raise error('%s:%d: label_type IMAGE reads the second word as the class of '
                            'the whole image (0 to 255), got %s; label images need '
                            'label_type: PIXEL' % (path, number, quote(label)))
            entries.append((prefix + words[0], int(label)))
        else:
            entries.append((prefix + words[0], prefix + label))
    return entries


def _is_class(word):
    return word.isdigit() and int(word) <= 255


def read_pair(image_path, label, color=True, error=CaffeError, source='the list', size=(0, 0),
              ignore_label=IGNORE_LABEL):
    """The image (H x W x C uint8) and its label map (H x W uint8) from the files the list
    file ``source`` names, both resized (bilinear) to ``size`` when it is not 0. ``label``
    is the label map's path, a class for every pixel, or None (every pixel
    ``ignore_label``)."""
    height, width = size
    image = read_image(listed(image_path, source, error), color, height, width)
    if label is None or isinstance(label, int):
        value = ignore_label if label is None else label
        return image, np.full(image.shape[:2], value, np.uint8)
    label_path = label
    labels = imread(listed(label_path, source, error), cv2().IMREAD_GRAYSCALE)
    if labels is None:
        raise error('could not open or decode label map %s' % quote(label_path))
    labels = resize(labels, height, width)
    if image.shape[:2] != labels.shape:
        raise error('image %s is %d x %d but its label map %s is %d x %d (paired in %s)'
                    % (quote(image_path), image.shape[0], image.shape[1], quote(label_path),
                       labels.shape[0], labels.shape[1], source))
    return image, labels


class SegTransformer:
    """Rescale, crop/pad, mirror and normalize image/label pairs (see the module doc)."""

    def __init__(self, param, phase, rng, ignore_label=IGNORE_LABEL, error=CaffeError,
                 deeplab=False):
        self.error = error
        self.train = phase == TRAIN
        self.rng = rng
        self.deeplab = deeplab
        self.scale = float(param.scale)
        self.mirror = bool(param.mirror)
        self.crop_size = int(param.crop_size)
        self.stride = max(1, int(param.stride))
        self.ratios = [float(r) for r in param.scale_ratios]
        self.factors = [float(f) for f in param.scale_factors] if deeplab else []
        self.ignore_label = ignore_label
        if param.mean_file:
            raise error('transform_param.mean_file is not supported for segmentation data; '
                        'use mean_value')
        self.mean_values = np.asarray(param.mean_value, np.float64)
        for field, values in (('scale_ratios', self.ratios), ('scale_factors', self.factors)):
            if any(r <= 0 for r in values):
                raise error('transform_param.%s must be > 0, got %s' % (field, values))
        self.window = (self.crop_size, self.crop_size) if self.crop_size else None
        if param.crop_height or param.crop_width:
            if not deeplab or param.crop_size or not (param.crop_height and param.crop_width):
                raise error('transform_param: give crop_size, or both crop_height and crop_width '
                            "(DeepLab's ImageSegData), not both")
            self.window = (int(param.crop_height), int(param.crop_width))

    def output_size(self, height, width):
        """(h, w) of the windows cut from a (rescaled) image of height x width."""
        if self.window:
            return self.window
        return height // self.stride * self.stride, width // self.stride * self.stride

    def _random_ratio(self):
        """DeepLab's scale_factors: one of them, with equal chances, in every phase. Two
        scale_ratios are a range [low, high] in steps of 0.001 (yjxiong's rule); one or
        more than two are the factors to choose from."""
        if self.factors:
            return self.factors[self.rng.randint(len(self.factors))]
        if not self.train or not self.ratios:
            return 1.0
        if len(self.ratios) == 2:
            low, high = sorted(self.ratios)
            return low + self.rng.randint(int((high - low) * 1000) + 1) / 1000.0
        return self.ratios[self.rng.randint(len(self.ratios))]

    def _offset(self, size, window):
        """Start of the window along one axis; 0 when the window is larger (padding)."""
        if size <= window:
            return 0
        return self.rng.randint(size - window + 1) if self.train else (size - window) // 2

    def __call__(self, pairs, dtype=np.float32, balance=False):
        """(data N x C x h x w, labels N x 1 x h x w) of ``dtype`` from (image, labels) pairs.

        With ``balance`` (yjxiong's seg_data_param.balance) a pair is drawn again, up to 10
        times, while one label covers more than 80% of its window.
        """
        return self.batches(pairs, [len(pairs)], dtype, balance)[0]

    def batches(self, pairs, sizes, dtype=np.float32, balance=False, rngs=None):
        """One (data, labels) per entry of ``sizes``, each from the next ``size`` pairs (None
        for a size of 0): one device's batch each. Every pair is rescaled first and then
        windowed in order, so the random draws are the same however the pairs are grouped.
        Windows must agree within a group, not between groups. ``rngs``: one generator per
        pair for all its random draws (else ``rng``), so that they do not depend on the
        other pairs read with it."""
        dtype = np.dtype(dtype)
        own = self.rng
        rngs = rngs if rngs is not None else [own] * len(pairs)
        pairs = [(image.reshape(image.shape[:2] + (-1,)), labels) for image, labels in pairs]
        scaled = []
        try:
            for rng, (image, labels) in zip(rngs, pairs):
                self.rng = rng
                scaled.append(self._rescale(image, labels))
            out, start = [], 0
            for size in sizes:
                group = list(range(start, start + size))
                out.append(self._assemble(pairs, scaled, group, dtype, balance, rngs)
                           if group else None)
                start += size
        finally:
            self.rng = own
        return out

    def _assemble(self, pairs, scaled, group, dtype, balance, rngs):
        channels = pairs[group[0]][0].shape[2]
        if len(self.mean_values) not in (0, 1, channels):
            raise self.error('transform_param: give 1 mean_value or one per channel (%d), got %d'
                             % (channels, len(self.mean_values)))
        mean = np.zeros(channels, dtype)
        mean[...] = self.mean_values if len(self.mean_values) else 0
        sizes = {self.output_size(*scaled[i][0].shape[:2]) for i in group}
        if len(sizes) > 1:
            raise self.error('images of different sizes in one batch need crop_size (window '
                             'sizes %s): add transform_param { crop_size: N }, or give each '
                             'device one image (batch_size: 1)' % sorted(sizes))
        h, w = sizes.pop()
        data = np.zeros((len(group), channels, h, w), dtype)
        labels = np.full((len(group), 1, h, w), self.ignore_label, dtype)
        for row, i in enumerate(group):
            self.rng = rngs[i]
            window, window_labels = self._window(*scaled[i], h, w)
            for _ in range(10 if balance and self.train else 0):
                if np.bincount(window_labels.ravel()).max() <= 0.8 * window_labels.size:
                    break
                window, window_labels = self._window(*self._rescale(*pairs[i]), h, w)
            wh, ww = window_labels.shape
            data[row, :, :wh, :ww] = (window.astype(dtype) - mean[:, None, None]) \
                * dtype.type(self.scale)
            labels[row, 0, :wh, :ww] = window_labels
        return data, labels

    def _window(self, image, label_map, h, w):
        """The (C x h' x w' image, h' x w' labels) window, h' <= h and w' <= w, maybe flipped."""
        top, left = self._offset(image.shape[0], h), self._offset(image.shape[1], w)
        rows, cols = slice(top, top + h), slice(left, left + w)
        window, window_labels = hwc_to_chw(image[rows, cols]), label_map[rows, cols]
        if self.mirror and (self.train or self.deeplab) and self.rng.randint(2):
            window, window_labels = window[:, :, ::-1], window_labels[:, ::-1]
        return window, window_labels

    def _rescale(self, image, label_map):
        ratio = self._random_ratio()
        if ratio == 1.0:
            return image, label_map
        cv = cv2()
        if self.deeplab:              # DeepLab truncates H * factor, in float
            height = int(np.float32(image.shape[0]) * np.float32(ratio))
            width = int(np.float32(image.shape[1]) * np.float32(ratio))
        else:
            height = int(image.shape[0] * ratio + 0.5)
            width = int(image.shape[1] * ratio + 0.5)
        resized = cv.resize(image, (width, height), interpolation=cv.INTER_LINEAR)
        label_map = cv.resize(label_map, (width, height), interpolation=cv.INTER_NEAREST)
        return resized.reshape((height, width, image.shape[2])), label_map
