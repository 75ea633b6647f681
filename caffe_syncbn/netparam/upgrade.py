"""Bringing old nets up to date, as Caffe does when it loads them.

``upgrade_net_param`` does what Caffe's UpgradeNetAsNeeded does for the formats still
found in the wild: V1 ``layers {}`` lists (enum types, DeepLab v1's among them,
blobs_lr/weight_decay), the
transform fields V1 data layers kept in their own params, the deprecated net-level
``input``/``input_shape``/``input_dim``, and BatchNorm layers that declare three param
specs. The even older V0 format is refused with a clear error.

``load_net_param`` reads a prototxt (or takes a NetParameter) and upgrades it.
"""
import logging
import os

from .. import caffe_pb2
from ..errors import CaffeError, naming, quote
from .prototxt import read_prototxt

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
    # DeepLab v1's (the fork names those it lacks: forks.py)
    'IMAGE_SEG_DATA': 'ImageSegData', 'SEG_ACCURACY': 'SegAccuracy', 'INTERP': 'Interp',
    'MAT_WRITE': 'MatWrite', 'MAT_READ': 'MatRead', 'PADDING': 'Padding',
    'DENSE_CRF': 'DenseCRF', 'DOMINANT_CHANNEL': 'DominantChannel',
    'BIAS_CHANNEL': 'BiasChannel', 'UNIQUE_LABEL': 'UniqueLabel', 'CENSOR_LABEL': 'CensorLabel',
    'ADAPTIVE_BIAS_CHANNEL': 'AdaptiveBiasChannel', 'CHANNEL_AGGREGATOR': 'ChannelAggregator',
    'IGNORE_OVERLAY': 'IgnoreOverlay', 'HISTOGRAM': 'Histogram', 'RELATIVE_ERROR': 'RelativeError',
    'GAIN_CHANNEL': 'GainChannel', 'ONEHOT': 'OneHot',
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


def load_net_param(model):
    """A V2 NetParameter from a prototxt path or a NetParameter (upgraded when legacy)."""
    if isinstance(model, caffe_pb2.NetParameter):
        return upgrade_net_param(model)
    path = os.fspath(model)
    with naming(path):
        return upgrade_net_param(read_prototxt(path, caffe_pb2.NetParameter()))
