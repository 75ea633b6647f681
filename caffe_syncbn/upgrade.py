"""Bringing old nets up to date, and swapping data layers for Input layers.

``upgrade_net_param`` does what Caffe's UpgradeNetAsNeeded does for the formats still
found in the wild: V1 ``layers {}`` lists (enum types, blobs_lr/weight_decay), the
transform fields V1 data layers kept in their own params, the deprecated net-level
``input``/``input_shape``/``input_dim``, and BatchNorm layers that declare three param
specs. The even older V0 format is refused with a clear error.

``upgrade_file`` writes an upgraded copy of a net prototxt, a binary caffemodel or a
solver prototxt, as Caffe's upgrade_net_proto_text, upgrade_net_proto_binary and
upgrade_solver_proto_text do. ``swap_data_layers_for_inputs`` lets a train/val net be
built without its data.
"""
import logging
import os

from . import caffe_pb2
from .errors import CaffeError, quote

log = logging.getLogger('caffe_syncbn')

V1 = caffe_pb2.V1LayerParameter

# V1LayerParameter.LayerType enum name -> the type string of the modern format
V1_TYPE_NAMES = {
    'NONE': '', 'ABSVAL': 'AbsVal', 'ACCURACY': 'Accuracy', 'ARGMAX': 'ArgMax', 'BNLL': 'BNLL',
    'CONCAT': 'Concat', 'CONTRASTIVE_LOSS': 'ContrastiveLoss', 'CONVOLUTION': 'Convolution',
    'DATA': 'Data', 'DECONVOLUTION': 'Deconvolution', 'DROPOUT': 'Dropout',
    'DUMMY_DATA': 'DummyData', 'EUCLIDEAN_LOSS': 'EuclideanLoss', 'ELTWISE': 'Eltwise',
    'EXP': 'Exp', 'FLATTEN': 'Flatten', 'HDF5_DATA': 'HDF5Data', 'HDF5_OUTPUT': 'HDF5Output',
    'HINGE_LOSS': 'HingeLoss', 'IM2COL': 'Im2col', 'IMAGE_DATA': 'ImageData',
    'INFOGAIN_LOSS': 'InfogainLoss', 'INNER_PRODUCT': 'InnerProduct', 'LRN': 'LRN',
    'MEMORY_DATA': 'MemoryData', 'MULTINOMIAL_LOGISTIC_LOSS': 'MultinomialLogisticLoss',
    'MVN': 'MVN', 'POOLING': 'Pooling', 'POWER': 'Power', 'RELU': 'ReLU', 'SIGMOID': 'Sigmoid',
    'SIGMOID_CROSS_ENTROPY_LOSS': 'SigmoidCrossEntropyLoss', 'SILENCE': 'Silence',
    'SOFTMAX': 'Softmax', 'SOFTMAX_LOSS': 'SoftmaxWithLoss', 'SPLIT': 'Split', 'SLICE': 'Slice',
    'TANH': 'TanH', 'WINDOW_DATA': 'WindowData', 'THRESHOLD': 'Threshold',
}

# V1 data layers whose own params still held the transform settings
_V1_TRANSFORM_OWNERS = {V1.DATA: 'data_param', V1.IMAGE_DATA: 'image_data_param',
                        V1.WINDOW_DATA: 'window_data_param'}
_TRANSFORM_FIELDS = ('scale', 'mean_file', 'crop_size', 'mirror')
# V1 fields handled one by one; every other set field is a *_param copied by name
_V1_OWN_FIELDS = {'bottom', 'top', 'name', 'include', 'exclude', 'type', 'blobs', 'param',
                  'blob_share_mode', 'blobs_lr', 'weight_decay', 'loss_weight', 'layer'}


# ---- upgrades ---------------------------------------------------------------------------
def _upgrade_v1_layer(v1, out):
    """Fill LayerParameter ``out`` from V1LayerParameter ``v1``."""
    if v1.HasField('layer'):
        raise CaffeError("layer '%s' uses the V0 layer format (layers { layer { ... } }), which "
                         'is not supported; convert the net with a Caffe release first' % v1.name)
    out.name = v1.name
    out.type = V1_TYPE_NAMES[V1.LayerType.Name(v1.type)]
    out.bottom.extend(v1.bottom)
    out.top.extend(v1.top)
    out.include.extend(v1.include)
    out.exclude.extend(v1.exclude)
    out.blobs.extend(v1.blobs)
    out.loss_weight.extend(v1.loss_weight)
    per_param = max(len(v1.param), len(v1.blob_share_mode), len(v1.blobs_lr), len(v1.weight_decay))
    for i in range(per_param):
        spec = out.param.add()
        if i < len(v1.param):
            spec.name = v1.param[i]
        if i < len(v1.blob_share_mode):
            spec.share_mode = v1.blob_share_mode[i]     # same numbers as ParamSpec's enum
        if i < len(v1.blobs_lr):
            spec.lr_mult = v1.blobs_lr[i]
        if i < len(v1.weight_decay):
            spec.decay_mult = v1.weight_decay[i]
    owner = _V1_TRANSFORM_OWNERS.get(v1.type)
    for field, value in v1.ListFields():
        if field.name in _V1_OWN_FIELDS:
            continue
        target = getattr(out, field.name)
        target.CopyFrom(value)
        if field.name == owner:
            for name in _TRANSFORM_FIELDS:          # Caffe moves these to transform_param
                if target.HasField(name):
                    setattr(out.transform_param, name, getattr(target, name))
                    target.ClearField(name)


def _upgrade_input_fields(net):
    """Turn the deprecated net-level inputs into an Input layer named 'input', placed first."""
    names, shapes, dims = list(net.input), list(net.input_shape), list(net.input_dim)
    if not names and (shapes or dims):
        raise CaffeError('net %s has input_shape/input_dim but no input names' % quote(net.name))
    if not names:
        return
    if shapes and len(shapes) != len(names):
        raise CaffeError('net %s has %d inputs but %d input_shape entries'
                         % (quote(net.name), len(names), len(shapes)))
    if not shapes:
        if len(dims) != 4 * len(names):
            raise CaffeError('net %s has %d inputs, so it needs %d input_dim values (N, C, H, W '
                             'each), got %d'
                             % (quote(net.name), len(names), 4 * len(names), len(dims)))
        shapes = [caffe_pb2.BlobShape(dim=dims[4 * i:4 * i + 4]) for i in range(len(names))]
    layer = caffe_pb2.LayerParameter(name='input', type='Input', top=names)
    layer.input_param.shape.extend(shapes)
    layers = [layer] + list(net.layer)
    del net.layer[:]
    net.layer.extend(layers)
    for field in ('input', 'input_shape', 'input_dim'):
        net.ClearField(field)


def _upgrade_batch_norm(net):
    """Old BatchNorm definitions declared three params; Caffe then fixes them all at 0."""
    for layer in net.layer:
        if layer.type == 'BatchNorm' and len(layer.param) == 3:
            for spec in layer.param:
                spec.lr_mult = 0
                spec.decay_mult = 0


def upgrade_net_param(net_param):
    """A V2 copy of ``net_param`` (prototxt or caffemodel), upgraded as Caffe does on load."""
    if len(net_param.layer) and len(net_param.layers):
        raise CaffeError("net %s mixes the 'layer' (V2) and 'layers' (V1) fields; use one"
                         % quote(net_param.name))
    net = caffe_pb2.NetParameter()
    net.CopyFrom(net_param)
    if len(net.layers):
        for v1 in net.layers:
            _upgrade_v1_layer(v1, net.layer.add())
        net.ClearField('layers')
    _upgrade_input_fields(net)
    _upgrade_batch_norm(net)
    return net


def upgrade_file(source, target):
    """Write ``source`` (a net prototxt, a binary caffemodel or a solver prototxt) to
    ``target`` in the current format, atomically, in the form it came in (text or binary).
    Returns what the file is: 'net prototxt', 'binary net' or 'solver prototxt'."""
    from google.protobuf import text_format

    from .io.atomic import atomic_write
    from .io.blobs import HDF5_MAGIC, parse_binary_file
    from .solvers.params import copy_message, upgrade_solver_param
    with open(source, 'rb') as f:
        head = f.read(1 << 16)
    if not head:
        raise CaffeError('%s is empty' % source)
    if head.startswith(HDF5_MAGIC):
        raise CaffeError('%s is an HDF5 caffemodel; HDF5 weights were never written in an old '
                         'format, so there is nothing to upgrade' % source)
    if _is_text(head):
        kind, original = _read_text_net_or_solver(source)
    else:
        kind, original = 'binary net', parse_binary_file(source, caffe_pb2.NetParameter)
    if kind == 'solver prototxt':
        upgraded = upgrade_solver_param(copy_message(original), source)
    else:
        upgraded = upgrade_net_param(original)
    if upgraded == original:
        log.info('%s is already in the current format; writing it unchanged', source)
    with atomic_write(target) as f:
        if kind == 'binary net':
            f.write(upgraded.SerializeToString())
        else:
            f.write(text_format.MessageToString(upgraded).encode('utf-8'))
    log.info('Wrote the upgraded %s to %s', kind, target)
    return kind


def _is_text(head):
    """Prototxt is UTF-8 without NUL bytes; a binary protobuf has both (tags, zeros)."""
    if b'\0' in head:
        return False
    try:
        head.decode('utf-8')
    except UnicodeDecodeError as exc:   # valid up to a character cut at the end of the head
        return exc.start >= len(head) - 3
    return True


def _read_text_net_or_solver(path):
    """('net prototxt' or 'solver prototxt', message): a file that is neither gets the
    parse error of the kind it looks more like."""
    from .prototxt import read_prototxt
    attempts = [('net prototxt', caffe_pb2.NetParameter), ('solver prototxt', caffe_pb2.SolverParameter)]
    errors = []
    for kind, message_class in attempts:
        try:
            return kind, read_prototxt(path, message_class())
        except CaffeError as exc:
            errors.append(exc)
    with open(path, encoding='utf-8', errors='replace') as f:
        looks_like_solver = any(word in f.read() for word in ('base_lr', 'max_iter', 'lr_policy'))
    raise errors[1 if looks_like_solver else 0]


# ---- data layers -> Input layers -----------------------------------------------------------
#: layer types that read data from outside the net (Python layers count when they have no bottom)
DATA_LAYER_TYPES = ('Data', 'ImageData', 'HDF5Data', 'WindowData', 'MemoryData', 'SegData',
                    'ImageSegData')
_LABEL_PER_PIXEL = ('SegData', 'ImageSegData', 'Python')   # their second top is a label image
_IMAGE_LIST_TYPES = ('ImageData', 'ImageSegData')          # read image_data_param
_DATASET_HINTS = (('mnist', (1, 28, 28)), ('cifar', (3, 32, 32)))
_DEFAULT_IMAGE = (3, 224, 224)


def is_data_layer(layer):
    return layer.type in DATA_LAYER_TYPES or (layer.type == 'Python' and not len(layer.bottom))


def _batch_size(layer):
    for field in ('data_param', 'image_data_param', 'window_data_param', 'memory_data_param',
                  'hdf5_data_param'):
        if layer.HasField(field) and getattr(layer, field).batch_size:
            return getattr(layer, field).batch_size
    return 1


def _hdf5_shapes(layer):
    """Dataset shapes (without the row axis) from the first listed file, if it is readable."""
    from .io.hdf5 import FAILURES
    source = layer.hdf5_data_param.source
    try:
        import h5py
        with open(source) as f:
            first = next(line.strip() for line in f if line.strip())
        with h5py.File(first, 'r') as h5:
            return {top: h5[top].shape[1:] for top in layer.top}
    except (StopIteration,) + FAILURES:       # a damaged list or file: no shapes from it
        return None


def _mean_file_shape(path):
    from .io.caffemodel import read_blob_proto
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
                  'window_data_param' if layer.type == 'WindowData' else 'data_param')
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
    mnist_scale = any(abs(tp.scale - s) < 1e-6 for s in (1 / 256.0, 1 / 255.0))
    if channels is None and mnist_scale and not tp.mean_file and not len(tp.mean_value):
        channels, height, width = _DATASET_HINTS[0][1]
    if len(tp.mean_value) > 1:
        channels = len(tp.mean_value)
    if tp.force_gray or (layer.type in _IMAGE_LIST_TYPES and not own.is_color):
        channels = 1
    if layer.type in _IMAGE_LIST_TYPES and own.new_height:
        height, width = layer.image_data_param.new_height, layer.image_data_param.new_width
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
           1x28x28, 'cifar' 3x32x32; an unnamed net scaled by 1/256 without a mean is taken
           for MNIST), else 224; C from mean_value count, is_color/force_gray, else 3;
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
