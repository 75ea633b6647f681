"""pycaffe's solver classes, one per solver type that registered its update rule
(rules.py: ``SGDSolver`` ... ``AdamSolver``), and ``get_solver``, the one way to build a
solver from a solver file, under ``import caffe_syncbn as caffe`` and after
``install_as_caffe()`` alike.

``get_solver(path)`` is pycaffe's single-device solver of the type the file names
(``SGDSolver`` ...), in the mode set_mode_cpu/set_mode_gpu chose, as pycaffe's
``caffe.get_solver(path)``; ``get_solver(path, devices='cpu:4', sync_bn=True)`` builds a
data-parallel solver. ``AdamSolver(path)`` forces a type.
"""
import os

from .. import caffe_pb2
from ..errors import CaffeError
from ..netparam.prototxt import parse_text
from ..netparam.solver_param import copy_message, load_solver_param, upgrade_solver_param
from .data_parallel import DataParallelSolver
from .rules import RULES, rule_class
from .solver import Solver


#: {SolverParameter.type: pycaffe's single-device solver class}, made on first use
_classes = {}


def get_solver_class(type_name, source=None):
    """The single-device solver class of a SolverParameter ``type`` ('SGD', 'Adam', ...):
    ``AdamSolver``, a Solver with the registered rule of the type."""
    rule = rule_class(type_name, source)     # the one error for an unknown type
    if type_name not in _classes or _classes[type_name].rule_class is not rule:
        _classes[type_name] = type(type_name + 'Solver', (Solver,), {
            'rule_class': rule,
            '__doc__': "Caffe's %s solver (see Solver)." % type_name,
            '__module__': __name__,
        })
    return _classes[type_name]


def solver_class_named(class_name):
    """pycaffe's solver class called ``class_name`` ('AdamSolver'), or None: one for every
    registered solver type, those registered after this module loaded included."""
    for type_name in RULES:
        if type_name + 'Solver' == class_name:
            return get_solver_class(type_name)
    return None


def __getattr__(name):
    """``from caffe_syncbn.training.solvers import AdamSolver``, and pickles of the classes."""
    found = solver_class_named(name)
    if found is None:
        raise AttributeError('module %r has no attribute %r' % (__name__, name))
    return found


def checked_solver_param(solver):
    """The SolverParameter of a solver file (or a copy of a message), upgraded and its type
    checked, so that a bad file is one error before any device starts."""
    if isinstance(solver, caffe_pb2.SolverParameter):
        param, source = upgrade_solver_param(copy_message(solver)), 'solver'
    else:
        source = os.fspath(solver)
        param = load_solver_param(source)
    rule_class(param.type, source)
    return param


def get_solver(solver, devices=None, sync_bn=False, dtype=None, level=None, stages=(),
               weights=None, mode='sync', max_staleness=None, memory_plan=None,
               sync_bn_group_size=None, precision='float32'):
    """The solver a solver prototxt (or SolverParameter) asks for. Without ``devices``,
    pycaffe's single-device solver (see below); else a data-parallel one running on
    ``devices``: 'cpu:4' (virtual CPU devices), 'gpu:0,1', 'gpu:all', or 'gpu:0,0'
    (replicas sharing a GPU).
    ``sync_bn`` turns every BatchNorm(+Scale) and BN of the nets into SyncBN;
    ``sync_bn_group_size`` K makes SyncBN share batch statistics within groups of K
    consecutive replicas (1: per-device batch norm; None: all replicas). ``level`` and
    ``stages`` add to the train net's NetState, and ``weights`` (caffemodel paths) replace
    the solver's own ``weights``, as caffe train's -level, -stage and -weights do. ``mode``
    'async' makes asynchronous updates, with replicas at most ``max_staleness`` updates
    ahead of the slowest (None: no bound). Under mpiexec or srun, every process's devices
    join one run. ``memory_plan`` is the nets' (Net's ``memory_plan``); None takes the
    solver file's ``memory_plan``, else pycaffe's default (memory_planner.DEFAULT_PLAN).
    ``precision`` 'float16' or 'bfloat16' trains in mixed precision (precision.py:
    activations and their diffs in half, params, updates, statistics and allreduces in
    float32; float16 with a dynamic loss scale, training/loss_scale.py).

    ``devices=None``: pycaffe's single-device solver of the file's type (``add_callback``
    works on it), in the mode set_mode_cpu/set_mode_gpu chose; it takes ``dtype``,
    ``memory_plan`` and ``precision`` only. On it, as on a data-parallel solver of one
    device, Input blobs set by hand (``solver.net.blobs['data'].data[...] = x``) are the
    data, as in Caffe."""
    param = checked_solver_param(solver)
    if isinstance(solver, caffe_pb2.SolverParameter):
        solver = param
    if devices is None:
        if sync_bn or level is not None or stages or weights is not None or mode != 'sync' \
                or max_staleness is not None or sync_bn_group_size is not None:
            raise CaffeError('get_solver: sync_bn, sync_bn_group_size, level, stages, weights, '
                             'mode and max_staleness need devices (devices=None: a '
                             'single-device solver)')
        return get_solver_class(param.type)(solver, dtype=dtype, memory_plan=memory_plan,
                                            precision=precision)
    return DataParallelSolver(solver, devices=devices, sync_bn=sync_bn, dtype=dtype, level=level,
                              stages=stages, weights=weights, mode=mode,
                              max_staleness=max_staleness, memory_plan=memory_plan,
                              sync_bn_group_size=sync_bn_group_size, precision=precision)


def get_solver_from_string(text, devices=None, **kwargs):
    """The solver that SolverParameter prototxt text asks for (its paths are relative to
    the current directory): as ``get_solver``, single-device unless ``devices`` are given."""
    return get_solver(parse_text(text, caffe_pb2.SolverParameter(), '<solver string>'),
                      devices=devices, **kwargs)
