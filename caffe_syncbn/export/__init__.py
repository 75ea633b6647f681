"""Export of Caffe nets to ONNX: ``to_onnx(net_param, weights, ...)`` (see model.py).

One small rule per Caffe layer type turns a layer into ONNX nodes (``graph.rule``); the
rules live by family in conv.py, detection.py, vision.py, norm.py, neuron.py, shape.py and
forks.py (the layers of other forks).
"""
from ..errors import CaffeError

try:
    # the rule modules register their rules as they are imported
    from . import conv, detection, neuron, norm, shape, vision  # noqa: F401
    from . import forks  # noqa: F401
    from .model import to_onnx
except ModuleNotFoundError as exc:
    if exc.name != 'onnx':
        raise

    def to_onnx(*args, **kwargs):
        raise CaffeError("ONNX export needs the onnx package: pip install 'caffe-syncbn[onnx]'")

__all__ = ['to_onnx']
