"""Caffe's solvers: SGD, Nesterov, AdaGrad, RMSProp, AdaDelta and Adam.

``get_solver('solver.prototxt')`` builds the solver its ``type`` names, as pycaffe's
``caffe.get_solver`` does; ``AdamSolver('solver.prototxt')`` forces a type.
"""
from .lr_policy import POLICIES, LearningRatePolicy
from .rules import RULES
from .params import load_solver_param, upgrade_solver_param
from .solver import Solver
from .state import SolverState, read_solver_state, write_solver_state


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
    """The solver class for a SolverParameter ``type`` ('SGD', 'Adam', ...)."""
    from ..errors import CaffeError, quote
    try:
        return _CLASSES[type_name]
    except KeyError:
        raise CaffeError('unknown solver type %s; expected one of %s'
                         % (quote(type_name), ', '.join(_CLASSES))) from None


def get_solver(solver, **kwargs):
    """Build the solver that a solver prototxt path (or SolverParameter) asks for."""
    from .. import caffe_pb2
    if isinstance(solver, caffe_pb2.SolverParameter):
        param = upgrade_solver_param(caffe_pb2.SolverParameter.FromString(solver.SerializeToString()))
        return get_solver_class(param.type)(param, **kwargs)
    return get_solver_class(load_solver_param(solver).type)(solver, **kwargs)


__all__ = ['Solver', 'SGDSolver', 'NesterovSolver', 'AdaGradSolver', 'RMSPropSolver',
           'AdaDeltaSolver', 'AdamSolver', 'get_solver', 'get_solver_class', 'load_solver_param',
           'upgrade_solver_param', 'LearningRatePolicy', 'POLICIES', 'SolverState',
           'read_solver_state', 'write_solver_state']
