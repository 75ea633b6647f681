"""Data layers swapped for Input layers, so that a train/val net is built without its data
(deploy nets, timing, drawing)."""
import os

from .. import caffe_pb2
from ..errors import CaffeError
from ..formats.blobs import read_blob_proto
from ..formats.hdf5 import FAILURES, other_files
from ..formats.regular import not_regular
from .upgrade import upgrade_net_param

# ---- data layers -> Input layers -----------------------------------------------------------
#: layer types that read data from outside the net (Python layers count when they have no bottom)
DATA_LAYER_TYPES = ('Data', 'ImageData', 'HDF5Data', 'WindowData', 'MemoryData', 'SegData',
                    'ImageSegData', 'DenseImageData', 'MatRead')


_LABEL_PER_PIXEL = ('SegData', 'ImageSegData', 'DenseImageData', 'Python')   # label images


_IMAGE_LIST_TYPES = ('ImageData', 'ImageSegData')          # read image_data_param


_DATASET_HINTS = (('mnist', (1, 28, 28)), ('cifar', (3, 32, 32)))


_DEFAULT_IMAGE = (3, 224, 224)


def is_data_layer(layer):
    return layer.type in DATA_LAYER_TYPES or (layer.type == 'Python' and not len(layer.bottom))


def _batch_size(layer):
    for field in ('data_param', 'image_data_param', 'window_data_param', 'memory_data_param',
                  'hdf5_data_param', 'dense_image_data_param', 'mat_read_param'):
        if layer.HasField(field) and getattr(layer, field).batch_size:
            return getattr(layer, field).batch_size
    return 1


def _hdf5_shapes(layer):
    """Dataset shapes (without the row axis) from the first listed file, if it is readable."""
    source = layer.hdf5_data_param.source
    try:
        import h5py
        if not_regular(source):               # opening a FIFO would wait for a writer
            return None
        with open(source) as f:
            first = next(line.strip() for line in f if line.strip())
        if not_regular(first):
            return None
        with h5py.File(first, 'r') as h5:
            if other_files(h5):               # its names could lead to a FIFO: the reader says so
                return None
            return {top: h5[top].shape[1:] for top in layer.top}
    except (StopIteration,) + FAILURES:       # a damaged list or file: no shapes from it
        return None


def _mean_file_shape(path):
    if not path or not os.path.isfile(path):
        return None
    try:
        return read_blob_proto(path).shape[-3:]
    except CaffeError:
        return None


def _image_shape(layer):
    """(C, H, W) of one image of a data layer, from its params, mean file or names."""
    tp = layer.transform_param
    own = getattr(layer, 'image_data_param' if layer.type in _IMAGE_LIST_TYPES else
                  'window_data_param' if layer.type == 'WindowData' else
                  'dense_image_data_param' if layer.type == 'DenseImageData' else 'data_param')
    if layer.type == 'MemoryData':
        mp = layer.memory_data_param
        return (mp.channels, mp.height, mp.width)
    channels, height, width = None, None, None
    names = ' '.join([tp.mean_file, getattr(own, 'source', ''), layer.seg_data_param.source])
    for hint, shape in _DATASET_HINTS:
        if hint in names.lower():
            channels, height, width = shape
    mean_shape = _mean_file_shape(tp.mean_file)
    if mean_shape is not None:
        channels, height, width = mean_shape
    if len(tp.mean_value) > 1:
        channels = len(tp.mean_value)
    resizes = layer.type in _IMAGE_LIST_TYPES + ('DenseImageData',)
    if tp.force_gray or (resizes and not own.is_color):
        channels = 1
    if resizes and own.new_height:
        height, width = own.new_height, own.new_width
    if layer.type == 'DenseImageData' and own.crop_height:
        height, width = own.crop_height, own.crop_width
    crop = tp.crop_size or getattr(own, 'crop_size', 0)
    if crop:
        height = width = crop
    default = _DEFAULT_IMAGE
    return (channels or default[0], height or default[1], width or default[2])


def _guess_top_shapes(layer, batch):
    if layer.type == 'HDF5Data':
        found = _hdf5_shapes(layer)
        if found:
            return [(batch,) + tuple(found[top]) for top in layer.top]
        return [(batch, 1)] + [(batch,)] * (len(layer.top) - 1)
    channels, height, width = _image_shape(layer)
    shapes = [(batch, channels, height, width)]
    dense = layer.dense_image_data_param
    cropped = layer.transform_param.crop_size or dense.crop_height
    if layer.type == 'DenseImageData' and not cropped:
        factor = max(1, dense.label_divide_factor)     # ENet's labels for its encoder
        height, width = height // factor, width // factor
    for _ in layer.top[1:]:
        shapes.append((batch, 1, height, width) if layer.type in _LABEL_PER_PIXEL else (batch,))
    return shapes


def swap_data_layers_for_inputs(net_param, shapes=None, batch=None):
    """A copy of ``net_param`` (upgraded to V2) whose data layers are Input layers.

    Data layers are the types in ``DATA_LAYER_TYPES`` and Python layers without bottoms.
    Each becomes an Input layer of the same name, tops and include/exclude rules, so each
    phase keeps its own. DummyData layers stay: they need no files.

    The shape of each top is, first match wins:
      1. ``shapes[top]`` when given (this also resizes tops of existing Input layers);
      2. a guess with the first axis ``batch`` (default: the layer's batch_size, or 1):
         - MemoryData: (N, channels, height, width); HDF5Data: the datasets of the first
           listed file when readable, else (N, 1) and labels (N,);
         - image layers: (N, C, H, W) with H, W from crop_size, ImageData's new_height/width,
           the mean file when readable, the dataset named in source/mean_file ('mnist' is
           1x28x28, 'cifar' 3x32x32), else 224; C from mean_value count,
           is_color/force_gray, else 3;
         - further tops: labels (N,), or (N, 1, H, W) for SegData, ImageSegData and
           Python layers.
    """
    shapes = {k: tuple(int(d) for d in v) for k, v in (shapes or {}).items()}
    net = upgrade_net_param(net_param)
    layers = []
    for layer in net.layer:
        if layer.type == 'Input':
            for i, top in enumerate(layer.top):
                if top in shapes:
                    _set_input_shape(layer, i, shapes[top])
        if not is_data_layer(layer):
            layers.append(layer)
            continue
        guessed = _guess_top_shapes(layer, batch or _batch_size(layer))
        swapped = caffe_pb2.LayerParameter(name=layer.name, type='Input', top=layer.top,
                                           include=layer.include, exclude=layer.exclude)
        for top, shape in zip(layer.top, guessed):
            swapped.input_param.shape.add(dim=shapes.get(top, shape))
        layers.append(swapped)
    del net.layer[:]
    net.layer.extend(layers)
    return net


def _set_input_shape(layer, index, shape):
    """Give top ``index`` of an Input layer its own shape (Input may share one for all)."""
    current = list(layer.input_param.shape)
    if len(current) != len(layer.top):
        current = [current[0] if current else caffe_pb2.BlobShape()] * len(layer.top)
    current = [caffe_pb2.BlobShape(dim=s.dim) for s in current]
    current[index] = caffe_pb2.BlobShape(dim=shape)
    del layer.input_param.shape[:]
    layer.input_param.shape.extend(current)
