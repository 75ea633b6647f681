"""The shapes of a data layer's tops, read from its source as Caffe's data layers read them.

A deploy net, a timed net or an exported one needs its inputs' shapes where the train_val
net has data layers. They come from where the layer itself would take them, never from a
dataset's name or a scale: Data from the first record of its LMDB (a raw Datum's channels,
height and width, an encoded one's decoded image), ImageData from new_height/new_width or
its first listed image, HDF5Data from the datasets of its first listed file, SegData,
ImageSegData and DenseImageData from their first image, MemoryData and WindowData from their params;
transform_param's crop_size then cuts the image. The first axis is the batch size.

Where the source cannot be read (missing, damaged, a Python layer), the answer is one
CaffeError naming the layer and the source, asking for ``--input-shape``.
"""
import logging

from .. import caffe_pb2
from ..errors import CaffeError, layer_error, quote
from ..formats.hdf5 import reading
from ..formats.regular import require_regular
from .datum import LMDBReader, datum_to_array, listed, parse_datum, read_image, record_name
from .imageset import read_image_list
from .dense_image import check_dense_param
from .segmentation import SegTransformer, read_pair_list, read_seg_lines

log = logging.getLogger('caffe_syncbn')

#: what the refusals ask for: the flag of to-deploy, to-onnx and time
ASK = 'give the input shape with --input-shape N,C,H,W'


def data_top_shapes(layer, batch=None, first=None):
    """[shape of each top] of the data layer ``layer`` (a V2 LayerParameter).

    ``batch`` replaces the layer's batch size; ``first`` (N, C, H, W), the user's
    --input-shape, is the first top's shape, and the other tops (labels) follow from it
    where the layer type says how. Anything read from a file is logged."""
    shapes = _READERS.get(layer.type, _python)(layer, batch, first)
    if first is None:
        log.info("Input shapes of layer '%s' (%s), as its source gives them: %s", layer.name,
                 layer.type, ', '.join('%s %s' % (top, 'x'.join(map(str, shape)))
                                       for top, shape in zip(layer.top, shapes)))
    return shapes


def _refusal(layer, source_field, source, reason):
    reason = str(reason)
    named = source_field if source and source in reason else '%s %s' % (source_field, quote(source))
    return layer_error(layer, 'cannot read its input shape from %s: %s; %s' % (named, reason, ASK))


def _batch(layer, batch, field, value):
    if batch:
        return int(batch)
    if value <= 0:
        raise layer_error(layer, '%s.batch_size must be > 0, got %d; %s' % (field, value, ASK))
    return int(value)


def _cropped(layer, where, channels, height, width):
    """(C, H, W) of an image of that size once transform_param's crop_size cuts it."""
    crop = layer.transform_param.crop_size
    if not crop:
        return channels, height, width
    if crop > height or crop > width:
        raise layer_error(layer, 'transform_param.crop_size %d is larger than %s, which is '
                                 '%d x %d' % (crop, where, height, width))
    return channels, crop, crop


def _labels(n, tops):
    return [(n,)] * (tops - 1)


def _lmdb(layer, batch, first):
    p = layer.data_param
    n = _batch(layer, batch, 'data_param', p.batch_size) if first is None else first[0]
    if first is not None:
        return [tuple(first)] + _labels(n, len(layer.top))
    if p.backend != p.LMDB:
        raise _refusal(layer, 'data_param.source', p.source, 'data_param.backend %s is not read '
                       '(only LMDB is)' % p.DB.Name(p.backend))
    tp = layer.transform_param
    color = True if tp.force_color else (False if tp.force_gray else None)
    try:
        key, value = LMDBReader(p.source, 'LMDB').first()
        where = record_name(key, p.source)
        datum = parse_datum(value, where)
        sample = ((datum.channels, datum.height, datum.width) if not datum.encoded
                  else datum_to_array(datum, color, where).shape)
        if min(sample) <= 0:
            raise CaffeError('%s: Datum has shape %s' % (where, list(sample)))
    except CaffeError as exc:
        raise _refusal(layer, 'data_param.source', p.source, exc) from None
    return [(n,) + _cropped(layer, 'its first record', *sample)] + _labels(n, len(layer.top))


def _image_list(layer, batch, first):
    p = layer.image_data_param
    n = _batch(layer, batch, 'image_data_param', p.batch_size) if first is None else first[0]
    if first is not None:
        return [tuple(first)] + _labels(n, len(layer.top))
    channels = 3 if p.is_color else 1
    if p.new_height > 0 and p.new_width > 0:
        size = (p.new_height, p.new_width)
    else:
        try:
            name = p.root_folder + read_image_list(p.source)[0][0]
            size = read_image(listed(name, p.source), p.is_color).shape[:2]
        except CaffeError as exc:
            raise _refusal(layer, 'image_data_param.source', p.source, exc) from None
    return [(n,) + _cropped(layer, 'its first image', channels, *size)] + \
        _labels(n, len(layer.top))


def _hdf5(layer, batch, first):
    import h5py
    p = layer.hdf5_data_param
    n = _batch(layer, batch, 'hdf5_data_param', p.batch_size) if first is None else first[0]
    try:
        require_regular(p.source, 'HDF5 file list')
        with open(p.source, errors='surrogateescape') as f:
            names = f.read().split()
        if not names:
            raise CaffeError('the list names no files')
        name = listed(names[0], p.source)
        with reading(quote(name), 'HDF5 data file'), h5py.File(name, 'r') as h5:
            missing = [top for top in layer.top if top not in h5]
            if missing:
                raise CaffeError('%s has no dataset %s' % (quote(name), quote(missing[0])))
            rows = [tuple(h5[top].shape[1:]) for top in layer.top]
    except OSError as exc:
        raise _refusal(layer, 'hdf5_data_param.source', p.source, exc.strerror) from None
    except CaffeError as exc:
        raise _refusal(layer, 'hdf5_data_param.source', p.source, exc) from None
    shapes = [(n,) + row for row in rows]
    return [tuple(first)] + shapes[1:] if first is not None else shapes


def _memory(layer, batch, first):
    p = layer.memory_data_param
    n = _batch(layer, batch, 'memory_data_param', p.batch_size) if first is None else first[0]
    if first is not None:
        return [tuple(first)] + _labels(n, len(layer.top))
    sample = (p.channels, p.height, p.width)
    if min(sample) <= 0:
        raise layer_error(layer, 'memory_data_param needs channels, height and width > 0, got '
                                 '%s; %s' % (list(sample), ASK))
    return [(n,) + sample] + _labels(n, len(layer.top))


def _window(layer, batch, first):
    """Caffe's WindowData cuts crop_size squares of colour images: (N, 3, crop, crop)."""
    p = layer.window_data_param
    n = _batch(layer, batch, 'window_data_param', p.batch_size) if first is None else first[0]
    if first is not None:
        return [tuple(first)] + _labels(n, len(layer.top))
    crop = layer.transform_param.crop_size or p.crop_size
    if not crop:
        raise layer_error(layer, 'WindowData needs transform_param.crop_size > 0; ' + ASK)
    return [(n, 3, crop, crop)] + _labels(n, len(layer.top))


def _segmentation(layer, batch, first):
    """Image, label map (N, 1, h, w) and DeepLab's data_dim (N, 1, 1, 2); colour images
    (ImageSegData's is_color: false, grey ones)."""
    if layer.type == 'SegData':
        p = layer.seg_data_param
        field, source, prefix = 'seg_data_param.source', p.source, p.root_dir
    else:
        p = layer.image_data_param
        field, source, prefix = 'image_data_param.source', p.source, p.root_folder
    fields = (('image_data_param', layer.image_data_param), ('data_param', layer.data_param))
    sizes = [param.batch_size for name, param in fields
             if layer.HasField(name) and param.HasField('batch_size')]
    if first is not None:
        n, channels, window = first[0], first[1], tuple(first[2:])
    else:
        n = _batch(layer, batch, 'image_data_param', sizes[0] if sizes else 1)
        deeplab = layer.type == 'ImageSegData'
        transformer = SegTransformer(layer.transform_param, caffe_pb2.TEST, None,
                                     error=lambda message: layer_error(layer, message),
                                     deeplab=deeplab)
        channels = 1 if deeplab and not p.is_color else 3
        if transformer.window:
            window = transformer.output_size(0, 0)
        else:
            try:
                if deeplab:
                    path = read_seg_lines(source, prefix, p.label_type, False)[0][0]
                    image = read_image(listed(path, source), height=p.new_height,
                                       width=p.new_width)
                else:
                    image = read_image(listed(read_pair_list(source, prefix)[0][0], source))
            except CaffeError as exc:
                raise _refusal(layer, field, source, exc) from None
            window = transformer.output_size(*image.shape[:2])
    shapes = [(n, channels) + window, (n, 1) + window, (n, 1, 1, 2)]
    return shapes[:len(layer.top)]


def _dense(layer, batch, first):
    """SegNet's DenseImageData: image and label image, the label's divided by ENet's
    label_divide_factor where nothing crops them."""
    p, crop = layer.dense_image_data_param, layer.transform_param.crop_size
    check_dense_param(p, lambda message: layer_error(layer, message))
    if first is not None:
        n, channels, window = first[0], first[1], tuple(first[2:])
    else:
        n = _batch(layer, batch, 'dense_image_data_param', p.batch_size)
        channels = 3 if p.is_color else 1
        if crop or p.crop_height:
            window = (crop, crop) if crop else (p.crop_height, p.crop_width)
        else:
            try:
                path = read_pair_list(p.source, p.root_folder)[0][0]
                image = read_image(listed(path, p.source), p.is_color, p.new_height, p.new_width)
            except CaffeError as exc:
                raise _refusal(layer, 'dense_image_data_param.source', p.source, exc) from None
            window = image.shape[:2]
    label = window if crop or p.crop_height else \
        tuple(size // p.label_divide_factor for size in window)
    return [(n, channels) + tuple(window), (n, 1) + tuple(label)][:len(layer.top)]


def _python(layer, batch, first):
    if first is None:
        raise layer_error(layer, 'the shape of its tops is known only to its own code; ' + ASK)
    if len(layer.top) > 1:
        raise layer_error(layer, 'the shape of its top %s is known only to its own code: make '
                                 'its tops Input layers' % quote(layer.top[1]))
    return [tuple(first)]


_READERS = {'Data': _lmdb, 'ImageData': _image_list, 'HDF5Data': _hdf5, 'MemoryData': _memory,
            'WindowData': _window, 'SegData': _segmentation, 'ImageSegData': _segmentation,
            'DenseImageData': _dense}
