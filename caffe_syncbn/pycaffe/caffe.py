"""pycaffe's ``caffe`` module on caffe_syncbn.

``caffe_syncbn.install_as_caffe()`` makes ``import caffe`` give this module, so scripts
written for pycaffe run unchanged. Beside the Net and the solvers it holds what pycaffe scripts use:
``io`` (Transformer, load_image, resize_image, oversample, blobproto and datum helpers),
``draw``, ``coord_map``, ``Classifier``, ``Detector``, ``layers``/``params``/``NetSpec``,
``proto.caffe_pb2`` and the process-wide helpers (``init_log``, ``Timer``, ``NCCL``, ...).
"""
from .. import __version__  # noqa: F401
from .. import netspec as net_spec  # noqa: F401
from ..backend import set_device, set_mode_cpu, set_mode_gpu  # noqa: F401
from ..blob import Blob  # noqa: F401
from ..errors import CaffeError  # noqa: F401
from ..fillers import set_random_seed  # noqa: F401
from ..layer import TEST, TRAIN, Layer, layer_type_list  # noqa: F401
from ..net import Net  # noqa: F401
from ..netspec import NetSpec, layers, params, to_proto  # noqa: F401
from ..solvers import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver,  # noqa: F401
                       RMSPropSolver, SGDSolver, get_solver, get_solver_from_string)
from . import coord_map, draw, io, proto  # noqa: F401
from .classifier import Classifier  # noqa: F401
from .detector import Detector  # noqa: F401
from .install import install_as_caffe  # noqa: F401
from .runtime import (NCCL, Timer, has_nccl, init_log, log, set_multiprocess,  # noqa: F401
                      set_solver_count, set_solver_rank, solver_count, solver_rank)
