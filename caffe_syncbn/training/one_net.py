"""The strategy of a solver on its own: its one net, in the caller's thread (what a
strategy is: see solver.py)."""
from .input_feed import feed
from .solver_checks import skipped_by_layer, take_skipped


class OneNet:
    """Caffe's single solver: the passes and the update of the solver's own net."""

    def __init__(self, solver):
        self.solver = solver

    def forward_backward_all(self):
        solver = self.solver
        return float(solver.accumulate(solver.net.clear_param_diffs, self._one_pass))

    def _one_pass(self, last):
        solver = self.solver
        feed(solver.net, solver.data_sources.get('train'))
        solver.net.loss_scale = solver.loss_scale.value
        return solver.net.forward_backward()

    def forward_all(self):
        solver = self.solver
        feed(solver.net, solver.data_sources.get('train'))
        return solver.net.forward_prefilled()

    def update(self, rate):
        self.solver.update_params(rate)

    def skipped_statistics(self):
        net = self.solver.net
        return skipped_by_layer(net, take_skipped(net), 1, self.solver.param.iter_size)
