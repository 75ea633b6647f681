"""pycaffe's ``caffe`` module on caffe_syncbn.

``caffe_syncbn.install_as_caffe()`` makes ``import caffe`` give this module, so scripts
written for pycaffe run unchanged. Beside the Net and the solvers it holds what pycaffe scripts use:
``io`` (Transformer, load_image, resize_image, oversample, blobproto and datum helpers),
``draw``, ``coord_map``, ``Classifier``, ``Detector``, ``layers``/``params``/``NetSpec``,
``proto.caffe_pb2`` and the process-wide helpers (``init_log``, ``Timer``, ``NCCL``, ...).
"""
import sys

from .. import __version__, caffe_pb2  # noqa: F401
from ..backend import set_device, set_mode_cpu, set_mode_gpu  # noqa: F401
from ..blob import Blob  # noqa: F401
from ..errors import CaffeError  # noqa: F401
from ..fillers import set_random_seed  # noqa: F401
from ..layer import TEST, TRAIN, Layer, layer_type_list  # noqa: F401
from ..net import Net  # noqa: F401
from ..training.solvers import get_solver, get_solver_from_string, solver_class_named  # noqa: F401
from . import net_spec  # noqa: F401
from . import classifier, coord_map, detector, draw, io, proto  # noqa: F401
from .classifier import Classifier  # noqa: F401
from .detector import Detector  # noqa: F401
from .net_spec import NetSpec, layers, params, to_proto  # noqa: F401
from .runtime import (NCCL, Timer, has_nccl, init_log, log, set_multiprocess,  # noqa: F401
                      set_solver_count, set_solver_rank, solver_count, solver_rank)


def __getattr__(name):
    """``caffe.SGDSolver`` ... ``caffe.AdamSolver``: a class for every registered solver type."""
    found = solver_class_named(name)
    if found is None:
        raise AttributeError("module 'caffe' has no attribute %r" % name)
    return found


def install_as_caffe():
    """Make ``import caffe`` give this module, with its submodules (caffe.io,
    caffe.proto.caffe_pb2, caffe.draw, caffe.coord_map, caffe.net_spec, caffe.classifier,
    caffe.detector), so that scripts written for pycaffe run unchanged. Returns it. Python
    layers that ``import caffe`` get it too. Call it before anything imports another
    ``caffe``."""
    this = sys.modules[__name__]
    present = sys.modules.get('caffe')
    if present is not None and present is not this:
        raise CaffeError('install_as_caffe(): another module named caffe is already imported (%s); '
                         'call install_as_caffe() before anything imports caffe'
                         % getattr(present, '__file__', present))
    sys.modules.update({
        'caffe': this, 'caffe.pycaffe': this, 'caffe.io': io, 'caffe.proto': proto,
        'caffe.proto.caffe_pb2': caffe_pb2, 'caffe.draw': draw, 'caffe.coord_map': coord_map,
        'caffe.net_spec': net_spec, 'caffe.classifier': classifier, 'caffe.detector': detector})
    return this
