"""Caffe's solvers: SGD, Nesterov, AdaGrad, RMSProp, AdaDelta and Adam.

``get_solver('solver.prototxt')`` builds the solver its ``type`` names, as pycaffe's
``caffe.get_solver`` does; ``AdamSolver('solver.prototxt')`` forces a type. These are the
single-device solvers of pycaffe, in the mode set_mode_cpu/set_mode_gpu chose.
"""
from .. import caffe_pb2
from ..errors import CaffeError, quote
from ..formats.solverstate import SolverState, read_solver_state, write_solver_state
from ..netparam.prototxt import parse_text
from ..netparam.solver_param import load_solver_param, upgrade_solver_param
from .lr_policy import POLICIES, LearningRatePolicy
from .rules import RULES
from .solver import Solver


class PycaffeSolver(Solver):
    """What pycaffe's solvers add to the loop: ``add_callback``, ``share_weights``, ``lr``."""

    def __init__(self, *args, **kwargs):
        self._callbacks = []
        super().__init__(*args, **kwargs)

    def add_callback(self, on_start, on_gradients_ready=None):
        """``on_start()`` runs before each iteration's forward/backward passes and
        ``on_gradients_ready()`` after them, before the update; or one object with those
        two methods (pycaffe's ``add_callback(nccl)``)."""
        # the data-parallel solver runs its replicas' passes itself, without these hooks
        if type(self).forward_backward_all is not PycaffeSolver.forward_backward_all:
            raise CaffeError('add_callback works with the single-device solvers (caffe.SGDSolver, '
                             'caffe.get_solver), not with %s' % type(self).__name__)
        if on_gradients_ready is None:
            on_start, on_gradients_ready = on_start.on_start, on_start.on_gradients_ready
        self._callbacks.append((on_start, on_gradients_ready))

    def forward_backward_all(self):
        for on_start, _ in self._callbacks:
            on_start()
        loss = super().forward_backward_all()
        for _, on_gradients_ready in self._callbacks:
            on_gradients_ready()
        return loss

    def share_weights(self, net):
        """Make ``net`` use this solver's train net weights (Net.share_with)."""
        net.share_with(self.net)

    @property
    def lr(self):
        """The learning rate of the current iteration."""
        return self.learning_rate()


def _solver_type(type_name):
    return type(type_name + 'Solver', (PycaffeSolver,), {
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
    try:
        return _CLASSES[type_name]
    except KeyError:
        raise CaffeError('unknown solver type %s; expected one of %s'
                         % (quote(type_name), ', '.join(_CLASSES))) from None


def get_solver_from_string(text, **kwargs):
    """Build the solver that SolverParameter prototxt text asks for (its paths are relative
    to the current directory)."""
    return get_solver(parse_text(text, caffe_pb2.SolverParameter(), '<solver string>'), **kwargs)


def get_solver(solver, **kwargs):
    """Build the solver that a solver prototxt path (or SolverParameter) asks for."""
    if isinstance(solver, caffe_pb2.SolverParameter):
        param = upgrade_solver_param(caffe_pb2.SolverParameter.FromString(solver.SerializeToString()))
        return get_solver_class(param.type)(param, **kwargs)
    return get_solver_class(load_solver_param(solver).type)(solver, **kwargs)


__all__ = ['Solver', 'SGDSolver', 'NesterovSolver', 'AdaGradSolver', 'RMSPropSolver',
           'AdaDeltaSolver', 'AdamSolver', 'PycaffeSolver', 'get_solver', 'get_solver_class',
           'get_solver_from_string', 'load_solver_param',
           'upgrade_solver_param', 'LearningRatePolicy', 'POLICIES', 'SolverState',
           'read_solver_state', 'write_solver_state']
