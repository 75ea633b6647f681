"""pycaffe's ``caffe.io``: arrays to and from BlobProto and Datum messages, images in and out
of a net's input layout (Transformer), and the resizing and cropping Classifier uses.

Images are H x W x K float arrays, RGB in [0, 1] as ``load_image`` gives them; a net's input
is K x H x W. Array results are float64 where pycaffe's are (arrays read from messages).
"""
import numpy as np

from .. import caffe_pb2
from ..data import datum as datum_io
from ..errors import CaffeError
from ..formats.blobs import array_to_blob, blob_to_array, length_delimited

_BLOB_DIFF_FIELD = caffe_pb2.BlobProto.DESCRIPTOR.fields_by_name['diff'].number


class InvalidInput(CaffeError, ValueError):
    """Arrays or settings caffe.io cannot use: a CaffeError, and the ValueError pycaffe raised."""


# ---- messages ---------------------------------------------------------------------------
def blobproto_to_array(blob, return_diff=False):
    """A BlobProto's data (or diff) as a float64 array of its shape (the legacy 4-D one
    when num/channels/height/width are set)."""
    try:
        return blob_to_array(blob, diff=return_diff).astype(np.float64)
    except CaffeError as exc:
        raise InvalidInput('blobproto_to_array: %s' % exc) from None


def array_to_blobproto(arr, diff=None):
    """A BlobProto of ``arr``'s shape holding it as float32 ``data`` (and ``diff``, of the
    same shape, when given), as pycaffe writes mean files."""
    arr = np.asarray(arr)
    blob = array_to_blob(arr.astype(np.float32))
    if diff is not None:
        diff = np.asarray(diff)
        if diff.shape != arr.shape:
            raise InvalidInput('array_to_blobproto: diff has shape %s, data %s' % (diff.shape, arr.shape))
        blob.MergeFromString(length_delimited(_BLOB_DIFF_FIELD, diff.astype('<f4').tobytes()))
    return blob


def arraylist_to_blobprotovector_str(arraylist):
    """Serialized BlobProtoVector bytes holding the given arrays."""
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend(array_to_blobproto(arr) for arr in arraylist)
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(data):
    """The arrays of serialized BlobProtoVector bytes."""
    return [blobproto_to_array(blob) for blob in caffe_pb2.BlobProtoVector.FromString(data).blobs]


def array_to_datum(arr, label=None):
    """A Datum of a C x H x W array: uint8 as raw ``data``, other types as ``float_data``.
    The label is left unset when None."""
    if np.ndim(arr) != 3:
        raise InvalidInput('array_to_datum: a Datum holds a C x H x W array, got shape %s'
                           % (np.shape(arr),))
    datum = datum_io.array_to_datum(arr)
    if label is None:
        datum.ClearField('label')
    else:
        datum.label = int(label)
    return datum


def datum_to_array(datum):
    """A Datum's C x H x W array: uint8 pixels, or float64 from float_data (encoded records
    are decoded with OpenCV, as BGR). The label stays in ``datum.label``."""
    array = datum_io.datum_to_array(datum, where='Datum')
    return array.astype(np.float64) if array.dtype != np.uint8 else array.copy()


# ---- images -----------------------------------------------------------------------------
def load_image(filename, color=True):
    """The image file as float32 H x W x 3 RGB in [0, 1] (H x W x 1 with ``color=False``).

    Gray images are repeated into 3 channels for ``color=True``; an alpha channel is dropped
    (``color=True``) or composited onto white before the conversion to gray, which weighs
    R, G, B as 0.2125, 0.7154, 0.0721 (pycaffe's scikit-image does the same)."""
    cv2 = datum_io.cv2()
    image = cv2.imread(str(filename), cv2.IMREAD_UNCHANGED)
    if image is None:
        raise CaffeError('could not open or decode image file %s' % filename)
    if image.dtype.kind in 'ui':
        image = image.astype(np.float32) / np.iinfo(image.dtype).max
    image = image.astype(np.float32)
    if image.ndim == 2:
        image = image[:, :, None]
    channels = image.shape[2]
    if channels >= 3:                    # OpenCV's BGR(A) to RGB(A)
        image = np.concatenate([image[:, :, 2::-1], image[:, :, 3:]], axis=2)
    if color:
        return np.repeat(image[:, :, :1], 3, axis=2) if channels <= 2 else image[:, :, :3]
    if channels in (2, 4):               # gray or colour with alpha, onto white
        alpha = image[:, :, -1:]
        image = image[:, :, :-1] * alpha + (1 - alpha)
    if image.shape[2] == 3:
        image = image @ np.array([0.2125, 0.7154, 0.0721], np.float32)
        image = image[:, :, None]
    return np.ascontiguousarray(image, np.float32)


def _linear_taps(size_in, size_out):
    """Bilinear interpolation along one axis with pixel centres aligned (a source position
    (i + 0.5) * size_in / size_out - 0.5) and the edge pixels repeated past the border."""
    position = (np.arange(size_out) + 0.5) * (size_in / size_out) - 0.5
    position = np.clip(position, 0, size_in - 1)
    low = np.floor(position).astype(np.intp)
    high = np.minimum(low + 1, size_in - 1)
    return low, high, position - low


def resize_image(im, new_dims, interp_order=1):
    """``im`` (H x W x K, any K) resized to new_dims = (height, width), as float32.

    Order 1 (the default) is bilinear, order 0 nearest; both align pixel centres and repeat
    the edge pixels, as OpenCV's INTER_LINEAR does. Other spline orders use SciPy."""
    im = np.asarray(im, np.float64)
    height, width = (int(d) for d in new_dims)
    if height < 1 or width < 1 or im.ndim < 2 or 0 in im.shape[:2]:
        raise InvalidInput('resize_image: cannot resize an image of shape %s to %s'
                         % (im.shape, tuple(new_dims)))
    if interp_order == 1:
        for axis, size in ((0, height), (1, width)):
            low, high, weight = _linear_taps(im.shape[axis], size)
            weight = weight.reshape((-1,) + (1,) * (im.ndim - axis - 1))
            im = np.take(im, low, axis) * (1 - weight) + np.take(im, high, axis) * weight
        return im.astype(np.float32)
    if interp_order == 0:
        rows = np.minimum(((np.arange(height) + 0.5) * im.shape[0] / height).astype(np.intp),
                          im.shape[0] - 1)
        cols = np.minimum(((np.arange(width) + 0.5) * im.shape[1] / width).astype(np.intp),
                          im.shape[1] - 1)
        return im[rows][:, cols].astype(np.float32)
    try:
        from scipy.ndimage import zoom
    except ImportError:
        raise CaffeError('resize_image with interp_order=%d needs SciPy (orders 0 and 1 do not)'
                         % interp_order) from None
    factors = (height / im.shape[0], width / im.shape[1]) + (1,) * (im.ndim - 2)
    return zoom(im, factors, order=interp_order, mode='nearest', grid_mode=True).astype(np.float32)


def oversample(images, crop_dims):
    """The 10 crops of each H x W x K image: the 4 corners (top-left, top-right, bottom-left,
    bottom-right) and the centre, then the same 5 mirrored left to right.

    Returns float32 (10 N) x crop height x crop width x K; all images share the first's size."""
    height, width = images[0].shape[:2]
    crop_h, crop_w = (int(d) for d in crop_dims)
    if crop_h > height or crop_w > width:
        raise InvalidInput('oversample: crops of %dx%d do not fit in images of %dx%d'
                         % (crop_h, crop_w, height, width))
    corners = [(0, 0), (0, width - crop_w), (height - crop_h, 0), (height - crop_h, width - crop_w),
               ((height - crop_h) // 2, (width - crop_w) // 2)]
    crops = []
    for im in images:
        five = [np.asarray(im)[top:top + crop_h, left:left + crop_w] for top, left in corners]
        crops += five + [crop[:, ::-1] for crop in five]
    return np.array(crops, dtype=np.float32)


def center_crop(images, crop_dims):
    """The centre crop of each image of an N x H x W x K array (Classifier without oversampling)."""
    height, width = images.shape[1:3]
    crop_h, crop_w = (int(d) for d in crop_dims)
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    return images[:, top:top + crop_h, left:left + crop_w]


# ---- preprocessing ----------------------------------------------------------------------
class Transformer:
    """Turns images into a net's input arrays (``preprocess``) and back (``deprocess``).

    ``inputs`` maps input names to blob shapes, e.g. ``{'data': net.blobs['data'].data.shape}``.
    ``preprocess`` does, per input as configured: float32; resize to the blob's H x W; transpose;
    channel swap; multiply by raw_scale; subtract the mean; multiply by input_scale.
    """

    def __init__(self, inputs):
        self.inputs = {name: tuple(int(d) for d in shape) for name, shape in inputs.items()}
        self.transpose = {}
        self.channel_swap = {}
        self.raw_scale = {}
        self.mean = {}
        self.input_scale = {}

    def _check_input(self, in_):
        if in_ not in self.inputs:
            raise InvalidInput("Transformer: '%s' is not one of the net inputs: %s"
                             % (in_, ', '.join(self.inputs)))

    def preprocess(self, in_, data):
        """An H' x W' x K image as a K x H x W float32 input of ``in_`` (the caller's array
        is never modified)."""
        self._check_input(in_)
        x = np.array(data, dtype=np.float32)
        spatial = self.inputs[in_][2:]
        if x.shape[:2] != spatial:
            x = resize_image(x, spatial)
        if in_ in self.transpose:
            x = x.transpose(self.transpose[in_])
        if in_ in self.channel_swap:
            x = x[list(self.channel_swap[in_])]
        if self.raw_scale.get(in_) is not None:
            x *= self.raw_scale[in_]
        if self.mean.get(in_) is not None:
            x -= self.mean[in_]
        if self.input_scale.get(in_) is not None:
            x *= self.input_scale[in_]
        return x

    def deprocess(self, in_, data):
        """preprocess undone (but for the resize): a net's K x H x W array as an image."""
        self._check_input(in_)
        x = np.array(data).squeeze()
        if self.input_scale.get(in_) is not None:
            x /= self.input_scale[in_]
        if self.mean.get(in_) is not None:
            x += self.mean[in_]
        if self.raw_scale.get(in_) is not None:
            x /= self.raw_scale[in_]
        if in_ in self.channel_swap:
            x = x[np.argsort(self.channel_swap[in_])]
        if in_ in self.transpose:
            x = x.transpose(np.argsort(self.transpose[in_]))
        return x

    def set_transpose(self, in_, order):
        """The axis order taking an image to the input, e.g. (2, 0, 1): H x W x K to K x H x W."""
        self._check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise InvalidInput("Transformer: transpose order %s for input '%s' of shape %s needs %d "
                             'axes' % (tuple(order), in_, self.inputs[in_], len(self.inputs[in_]) - 1))
        self.transpose[in_] = tuple(order)

    def set_channel_swap(self, in_, order):
        """The channel order after the transpose, e.g. (2, 1, 0) for RGB images and a BGR net."""
        self._check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise InvalidInput("Transformer: channel swap %s for input '%s' needs %d channels"
                             % (tuple(order), in_, self.inputs[in_][1]))
        self.channel_swap[in_] = tuple(order)

    def set_raw_scale(self, in_, scale):
        """Multiply the image by ``scale`` before the mean is subtracted (255 for models
        trained on [0, 255] pixels, as the ImageNet models were)."""
        self._check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean):
        """The mean to subtract: one value per channel (K), or K x H x W (H x W for one
        channel), resized to the input's H x W when it differs."""
        self._check_input(in_)
        mean = np.asarray(mean)
        channels, spatial = self.inputs[in_][1], self.inputs[in_][2:]
        if mean.ndim == 1:
            if mean.shape[0] != channels:
                raise InvalidInput("Transformer: mean has %d channels, input '%s' has %d"
                                 % (mean.shape[0], in_, channels))
            mean = mean[:, None, None]
        else:
            if mean.ndim == 2:
                mean = mean[None]
            if mean.ndim != 3 or mean.shape[0] != channels:
                raise InvalidInput("Transformer: mean of shape %s does not fit input '%s' of shape %s "
                                 '(give K or K x H x W values)' % (mean.shape, in_, self.inputs[in_]))
            if mean.shape[1:] != spatial:
                mean = resize_image(mean.transpose(1, 2, 0), spatial).transpose(2, 0, 1)
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale):
        """Multiply by ``scale`` after the mean is subtracted (raw_scale comes before it)."""
        self._check_input(in_)
        self.input_scale[in_] = scale
