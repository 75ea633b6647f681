"""Export of Caffe nets to ONNX: ``to_onnx(net_param, weights, ...)`` (see model.py).

One small rule per Caffe layer type turns a layer into ONNX nodes (``graph.rule``); the
rules live by family in conv.py, detection.py, vision.py, norm.py, neuron.py, shape.py and
forks.py (the layers of other forks), and model.py imports them all.
"""
import importlib

from ..errors import CaffeError


def to_onnx(*args, **kwargs):
    """model.to_onnx. The exporter and the onnx package (an extra) load on the first
    export, as the package's heavier parts do (caffe_syncbn.__getattr__), not with the
    command line that offers it: onnx adds 14 MiB to every process that imports it, a
    fifth of a small net's whole peak under `caffe-syncbn time`."""
    try:
        model = importlib.import_module('.model', __name__)
    except ModuleNotFoundError as exc:
        if exc.name != 'onnx':
            raise
        raise CaffeError("ONNX export needs the onnx package: pip install 'caffe-syncbn[onnx]'") \
            from None
    return model.to_onnx(*args, **kwargs)


__all__ = ['to_onnx']
