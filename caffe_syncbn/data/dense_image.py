"""SegNet's and ENet's DenseImageData: "<image> <label image>" pairs, as their Caffe reads
them (alexgkendall/caffe-segnet, TimoSaemann/caffe-enet, dense_image_data_layer.cpp).

Per pair: the image is read (colour unless is_color is false) and resized bilinearly to
new_height x new_width when both are set; the label image is read as grey levels and
resized by nearest neighbour to new_height / label_divide_factor x new_width /
label_divide_factor (ENet trains its encoder on labels a factor 8 smaller). Then, in
every phase as the forks do: a left-right flip of both with probability 1/2 when
dense_image_data_param.mirror is set, and a random crop_height x crop_width window of
both. transform_param follows: its crop_size and mirror (the same window and flip for the
label; the forks draw them again for the label, which misaligns the two in TRAIN), and
mean and scale for the image alone.
"""
from ..errors import CaffeError, quote
from .datum import cv2, imread, listed, read_image, resize


def check_dense_param(p, error=CaffeError):
    """Refuse the settings the forks cannot run, in one line each."""
    for first, second in (('new_height', 'new_width'), ('crop_height', 'crop_width')):
        if (getattr(p, first) > 0) != (getattr(p, second) > 0):
            raise error('dense_image_data_param: give both %s and %s, or neither'
                        % (first, second))
    if p.label_divide_factor < 1:
        raise error('dense_image_data_param.label_divide_factor must be >= 1, got %d'
                    % p.label_divide_factor)
    if p.label_divide_factor > 1 and not p.new_height:
        raise error('dense_image_data_param.label_divide_factor %d needs new_height and '
                    'new_width: the label image is resized to them, divided by it'
                    % p.label_divide_factor)
    if p.label_divide_factor > 1 and p.crop_height:
        raise error('dense_image_data_param: crop_height and crop_width cut the image and '
                    'its label alike, so they need label_divide_factor 1, got %d'
                    % p.label_divide_factor)


def read_dense_pair(image_path, label_path, p, error=CaffeError):
    """(image H x W (x C) uint8, labels h x w uint8) of one listed pair."""
    image = read_image(listed(image_path, p.source, error), p.is_color, p.new_height,
                       p.new_width)
    labels = imread(listed(label_path, p.source, error), cv2().IMREAD_GRAYSCALE)
    if labels is None:
        raise error('could not open or decode label image %s' % quote(label_path))
    factor = p.label_divide_factor
    labels = resize(labels, p.new_height // factor, p.new_width // factor, cv2().INTER_NEAREST)
    return image, labels


def dense_window(image, labels, p, rng, error=CaffeError):
    """The forks' own flip, then crop, of a pair (drawn in every phase)."""
    if p.mirror and rng.randint(2):
        image, labels = image[:, ::-1], labels[:, ::-1]
    if p.crop_height:
        height, width = image.shape[:2]
        if labels.shape != (height, width):
            raise error('an image of %d x %d has a label image of %d x %d: crop_height and '
                        'crop_width need them alike' % ((height, width) + labels.shape))
        if p.crop_height > height or p.crop_width > width:
            raise error('dense_image_data_param crop %d x %d is larger than an image of %d x %d'
                        % (p.crop_height, p.crop_width, height, width))
        top = rng.randint(height - p.crop_height + 1)
        left = rng.randint(width - p.crop_width + 1)
        rows, cols = slice(top, top + p.crop_height), slice(left, left + p.crop_width)
        image, labels = image[rows, cols], labels[rows, cols]
    return image, labels
