"""Caffe's solver types (SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam) and ``get_solver``,
the one way to build a solver from a solver file, under ``import caffe_syncbn as caffe``
and after ``install_as_caffe()`` alike.

``get_solver(path)`` is pycaffe's single-device solver of the type the file names
(``SGDSolver`` ...), in the mode set_mode_cpu/set_mode_gpu chose, as pycaffe's
``caffe.get_solver(path)``; ``get_solver(path, devices='cpu:4', sync_bn=True)`` builds a
data-parallel solver. ``AdamSolver(path)`` forces a type.
"""
from .. import caffe_pb2
from ..errors import CaffeError
from ..netparam.prototxt import parse_text
from ..netparam.solver_param import copy_message, load_solver_param, upgrade_solver_param
from .data_parallel import DataParallelSolver
from .rules import RULES, rule_class
from .solver import Solver


def _solver_type(type_name):
    return type(type_name + 'Solver', (Solver,), {
        'rule_class': RULES[type_name],
        '__doc__': "Caffe's %s solver (see Solver)." % type_name,
        '__module__': __name__,
    })


SGDSolver = _solver_type('SGD')
NesterovSolver = _solver_type('Nesterov')
AdaGradSolver = _solver_type('AdaGrad')
RMSPropSolver = _solver_type('RMSProp')
AdaDeltaSolver = _solver_type('AdaDelta')
AdamSolver = _solver_type('Adam')

_CLASSES = {'SGD': SGDSolver, 'Nesterov': NesterovSolver, 'AdaGrad': AdaGradSolver,
            'RMSProp': RMSPropSolver, 'AdaDelta': AdaDeltaSolver, 'Adam': AdamSolver}


def get_solver_class(type_name):
    """The single-device solver class of a SolverParameter ``type`` ('SGD', 'Adam', ...)."""
    rule_class(type_name)                    # the one error for an unknown type
    return _CLASSES[type_name]


def get_solver(solver, devices=None, sync_bn=False, dtype=None, level=None, stages=(),
               weights=None, mode='sync', max_staleness=None, memory_plan=None):
    """The solver a solver prototxt (or SolverParameter) asks for. Without ``devices``,
    pycaffe's single-device solver (see below); else a data-parallel one running on
    ``devices``: 'cpu:4' (virtual CPU devices), 'gpu:0,1', 'gpu:all', or 'gpu:0,0'
    (replicas sharing a GPU).
    ``sync_bn`` turns every BatchNorm(+Scale) and BN of the nets into SyncBN. ``level`` and
    ``stages`` add to the train net's NetState, and ``weights`` (caffemodel paths) replace
    the solver's own ``weights``, as caffe train's -level, -stage and -weights do. ``mode``
    'async' makes asynchronous updates, with replicas at most ``max_staleness`` updates
    ahead of the slowest (None: no bound). Under mpiexec or srun, every process's devices
    join one run. ``memory_plan`` is the nets' (Net's ``memory_plan``); None takes the
    solver file's ``memory_plan``, else pycaffe's default (memory_planner.DEFAULT_PLAN).

    ``devices=None``: pycaffe's single-device solver of the file's type (``add_callback``
    works on it), in the mode set_mode_cpu/set_mode_gpu chose; it takes ``dtype`` and
    ``memory_plan`` only. On it, as on a data-parallel solver of one device, Input blobs
    set by hand (``solver.net.blobs['data'].data[...] = x``) are the data, as in Caffe."""
    if isinstance(solver, caffe_pb2.SolverParameter):
        solver = param = upgrade_solver_param(copy_message(solver))
    else:
        param = load_solver_param(solver)  # a bad file is one error, before any device starts
    if devices is None:
        if sync_bn or level is not None or stages or weights is not None or mode != 'sync' \
                or max_staleness is not None:
            raise CaffeError('get_solver: sync_bn, level, stages, weights, mode and '
                             'max_staleness need devices (devices=None: a single-device solver)')
        return get_solver_class(param.type)(solver, dtype=dtype, memory_plan=memory_plan)
    return DataParallelSolver(solver, devices=devices, sync_bn=sync_bn, dtype=dtype, level=level,
                              stages=stages, weights=weights, mode=mode,
                              max_staleness=max_staleness, memory_plan=memory_plan)


def get_solver_from_string(text, devices=None, **kwargs):
    """The solver that SolverParameter prototxt text asks for (its paths are relative to
    the current directory): as ``get_solver``, single-device unless ``devices`` are given."""
    return get_solver(parse_text(text, caffe_pb2.SolverParameter(), '<solver string>'),
                      devices=devices, **kwargs)
