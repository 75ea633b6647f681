"""The solver driver: Caffe's Solver/SGDSolver loop, its tests, logs and snapshots.

One iteration is, as in Caffe: (test nets every ``test_interval``), ``forward_backward_all``
(the callbacks' ``on_start``, clear the param diffs, ``iter_size`` forward/backward
passes, the callbacks' ``on_gradients_ready``; the mean loss), then ``apply_update``
(learning rate, clip gradients, normalize by ``iter_size``, regularize, the type's update
rule, ``w -= update``), then ``iter += 1`` and maybe a snapshot.

Where the passes and updates run is the solver's ``strategy``, the one seam between the
loop and data parallelism. ``OneNet`` (one_net.py) runs the solver's own net in the caller's
thread; ``Synchronous`` and ``Asynchronous`` (synchronous.py, asynchronous.py) run
replicas. A strategy has four methods, and uses the solver's public ones only:

- ``forward_backward_all()``: this iteration's gradients, in the diffs of the solver's
  net; the mean loss. ``Solver.accumulate`` is the ``iter_size`` loop, for every strategy;
  then ``skipped_statistics()``: the SyncBN updates its passes skipped (solver_checks.py).
- ``forward_all()``: the display pass after training; the loss.
- ``update(rate)``: the update of every replica at ``rate`` (``Solver.update_params``).
"""
import logging
import os
import time

import numpy as np

from .. import caffe_pb2
from ..backend import cpu_threads, mode_array_module
from ..backend.one_caller import OneCaller, one_at_a_time
from ..errors import CaffeError, naming
from ..fillers import set_random_seed
from ..formats.atomic import remove_stale_temporaries
from ..glog import log_to_stderr_unless_configured
from ..layer import LayerContext
from ..memory_planner import DEFAULT_PLAN, check_plan
from ..net import Net
from ..net_sharing import holds_only_params_of
from ..netparam.layer_lines import naming_net_file
from ..netparam.solver_param import (check_net_files, copy_message, load_solver_param,
                                     test_net_params, train_net_param, upgrade_solver_param)
from ..precision import run_dtypes
from .loss_scale import LossScale
from .lr_policy import LearningRatePolicy
from .net_report import TestMeans, log_net_outputs, test_batch
from .one_net import OneNet
from .prefix_lock import PrefixLock
from .rules import ParamUpdate, rule_class
from .smoothed_loss import SmoothedLoss
from .snapshot_layout import NetLayout, restore_solver, snapshot_prefix_problem
from .solver_checks import (NAN_EFFECTS, FirstNonFinite, check_passes, check_solver_param,
                            effect_text)

log = logging.getLogger('caffe_syncbn')
#: what ``action_request`` may ask for between iterations: a snapshot, a stop, or both
ACTIONS = ('snapshot', 'stop', 'snapshot_stop')
#: what a second thread that calls a busy solver is told (backend/one_caller.py)
STEPS_ONE_AT_A_TIME = ('a solver takes one step at a time (its replicas take every step '
                       'together); call it from one thread')


class Solver:
    """Caffe's solver. ``Solver(solver_prototxt_or_SolverParameter, net=None)``.

    The update rule comes from the class (``AdamSolver``) or, for ``Solver`` itself,
    from the param's ``type``. ``net``/``test_nets`` are built from the param unless given.
    ``dtype`` and ``xp`` choose the float type and backend of the nets it builds, and
    ``precision`` their activations' (float32, or float16 or bfloat16: precision.py);
    ``strategy`` where the passes and updates run (see the module docstring; ``OneNet``
    unless given); ``memory_plan`` the Net's memory plan for the nets it builds (None:
    the solver file's ``memory_plan``, else pycaffe's default, DEFAULT_PLAN).
    """

    rule_class = None

    def __init__(self, solver, net=None, test_nets=None, dtype=None, xp=None, strategy=None,
                 memory_plan=None, precision='float32'):
        log_to_stderr_unless_configured()
        self._one_caller = OneCaller('the solver', STEPS_ONE_AT_A_TIME)
        self.strategy = strategy or OneNet(self)
        if isinstance(solver, caffe_pb2.SolverParameter):
            self.param, self.source = upgrade_solver_param(copy_message(solver)), 'solver'
        else:
            self.source = os.fspath(solver)
            self.param = load_solver_param(self.source)
        named = rule_class(self.param.type, self.source)    # checked where a class forces one too
        self.rule_class = self.rule_class or named
        self.memory_plan = check_plan(memory_plan or self.param.memory_plan or
                                      DEFAULT_PLAN['pycaffe'], None if memory_plan else self.source)
        self.xp, self.precision = xp, precision
        self.dtype, self.activation_dtype = run_dtypes(precision, dtype or (
            net.context.dtype if net is not None else None))
        #: the factor of the loss weights in the backward (loss_scale.py: float16's)
        self.loss_scale = LossScale(precision)
        if self.loss_scale.start_line():
            log.info('%s', self.loss_scale.start_line())
        p = self.param
        self.iter = 0
        check_solver_param(p, self.source)
        if net is None:
            check_net_files(p, self.source)
        self.prefix_lock = PrefixLock()
        if p.snapshot > 0 or p.snapshot_after_train:
            self.check_snapshot_prefix()
        if p.random_seed >= 0:
            set_random_seed(p.random_seed)
        cpu_threads.threads()        # the pool's threads start: a refused one is the first error
        if net is None:
            net = self._create_solver_net(train_net_param(p, self.source))
        self.net = net
        #: the layout of its weights and history in files: the net's own, or the user's prototxt
        self.snapshot_layout = self.make_snapshot_layout()
        self.on_net_device(lambda: self.load_weights(net))
        if test_nets is None:
            test_nets = [self._create_solver_net(n) for n in test_net_params(p, self.source)]
        elif len(p.test_iter) < len(test_nets):
            raise CaffeError('%s: test_iter must be given once per test net (%d test_iter for %d '
                             'test nets)' % (self.source, len(p.test_iter), len(test_nets)))
        self.test_nets = list(test_nets)
        for test_net in self.test_nets:       # what it shares, the train net has loaded
            test_net.share_weights_with(self.net)
            if not holds_only_params_of(test_net, self.net):
                self.on_net_device(lambda: self.load_weights(test_net))
        self.lr_policy = LearningRatePolicy(p, self.dtype, self.source)
        with naming(self.source):
            #: clipping, normalization, regularization and the rule, on the solver's net
            self.updater = self.on_net_device(
                lambda: ParamUpdate(p, self.net, self.rule_class, self.dtype))
        self.rule = self.updater.rule
        #: Caffe's root_solver(): only the root logs, tests and snapshots
        self.is_root = True
        #: called after every iteration and test batch: returns None or one of ACTIONS
        self.action_request = None
        #: what the first value that is not finite (loss, gradient, param, statistic) does
        #: besides a warning: 'none' (train on, as Caffe), 'snapshot' (the weights before
        #: that update), 'stop' (end before it)
        self.nan_effect = 'none'
        self._non_finite = FirstNonFinite()
        self.requested_early_exit = False
        #: whether the run stopped at a value that was not finite (nan_effect 'stop')
        self.stopped_on_non_finite = False
        self._snapshot_iter = None       # the iteration this step last snapshotted
        #: the seconds the last snapshot took to write, or None
        self.last_snapshot_seconds = None
        #: the learning rate of the last update
        self.last_rate = None
        self._smoothing = SmoothedLoss(p.average_loss, self.dtype)
        #: set_data_source's sources: {'train' or a test net's index: source}
        self.data_sources = {}
        #: (on_start, on_gradients_ready) pairs, run around each iteration's passes
        self.callbacks = []
        self.prepare_blas()

    def _create_solver_net(self, solver_net):
        """A net the solver names; its errors name its file (and line) or the solver file."""
        param = solver_net.param
        with naming_net_file(solver_net.file, param) if solver_net.file else naming(self.source):
            return self.create_net(param, param.state.phase)

    def create_net(self, net_param, phase):
        """Build one Net (overridden by solvers that place nets on devices)."""
        context = LayerContext(phase=phase, xp=self.xp or mode_array_module(), dtype=self.dtype,
                               activation_dtype=self.activation_dtype)
        return Net(net_param, phase, level=net_param.state.level, context=context,
                   memory_plan=self.memory_plan)

    def make_snapshot_layout(self):
        return NetLayout(self.net)

    def prepare_blas(self):
        """Under a memory limit, have the BLAS map its buffers now, once the nets are built,
        or say in one error that there is no room for them (cpu_threads.start): before the
        first iteration, where OpenBLAS's C code would end the process."""
        cpu_threads.start()

    def on_net_device(self, fn):
        """``fn()`` where the solver's net works: here, in the caller's thread. (A
        data-parallel solver runs it in replica 0's thread, on its device and stream.)"""
        return fn()

    def load_weights(self, net):
        """The solver's ``weights`` entries (each a comma-separated list), as Caffe finetunes."""
        for entry in self.param.weights:
            for path in (name.strip() for name in entry.split(',')):
                if path:
                    log.info('Finetuning from %s', path)
                    self.snapshot_layout.load_weights(net, path)

    # ---- data -------------------------------------------------------------------------------
    def set_data_source(self, source, test_net=None):
        """Feed Input blobs: ``source()`` returns {blob name: array} before every forward.

        ``test_net=None`` feeds the train net, an index feeds that test net.
        """
        self.data_sources['train' if test_net is None else int(test_net)] = source

    # ---- one iteration ------------------------------------------------------------------------
    def add_callback(self, on_start, on_gradients_ready=None):
        """``on_start()`` runs before each iteration's forward/backward passes and
        ``on_gradients_ready()`` after them, before the update; or one object with those
        two methods (pycaffe's ``add_callback(nccl)``)."""
        if on_gradients_ready is None:
            on_start, on_gradients_ready = on_start.on_start, on_start.on_gradients_ready
        self.callbacks.append((on_start, on_gradients_ready))

    def forward_backward_all(self):
        """This iteration's gradients (the strategy's passes, between the callbacks); the
        mean loss."""
        for on_start, _ in self.callbacks:
            on_start()
        loss = self.strategy.forward_backward_all()
        for _, on_gradients_ready in self.callbacks:
            on_gradients_ready()
        return loss

    def accumulate(self, clear, one_pass, dtype=None):
        """Caffe's ``iter_size``: ``clear()`` the param diffs, then ``iter_size`` calls of
        ``one_pass(last)``, each one forward/backward pass whose gradients add to the diffs
        (``last``: the gradients are complete after it); the mean of the losses they return
        (numbers, or arrays of one loss per replica), added up in ``dtype`` (the solver's,
        as Caffe does)."""
        d = np.dtype(dtype or self.dtype).type
        iter_size = self.param.iter_size
        clear()
        loss = d(0)
        for k in range(iter_size):
            loss += d(one_pass(k == iter_size - 1))
        return loss / d(iter_size)

    def forward_all(self):
        """A forward pass only (the display pass after training); returns the loss."""
        return self.strategy.forward_all()

    def learning_rate(self):
        return self.lr_policy.rate(self.iter)

    @property
    def lr(self):
        """The learning rate of the current iteration (pycaffe's ``solver.lr``)."""
        return self.learning_rate()

    def share_weights(self, net):
        """Make ``net`` use this solver's train net weights (Net.share_with)."""
        net.share_with(self.net)

    @property
    def current_step(self):
        return self.lr_policy.current_step

    def _displaying(self):
        return self.param.display and self.iter % self.param.display == 0

    def apply_update(self):
        """Turn the accumulated diffs into one update of every learnable param."""
        rate = self.last_rate = self.learning_rate()
        if self._displaying() and self.is_root:
            log.info('Iteration %d, lr = %g', self.iter, rate)
        self.strategy.update(rate)
        return rate

    def update_params(self, rate):
        """Clip, normalize and regularize the diffs, and apply the update rule at ``rate``."""
        clipped = self.updater.apply(rate, self.iter)
        if clipped and self.is_root:
            log.info('Gradient clipping: scaling down gradients (L2 norm %g > %g) by scale '
                     'factor %g', *clipped)

    # ---- the loop -----------------------------------------------------------------------------
    @one_at_a_time('step')
    def step(self, iters):
        """Run ``iters`` iterations (fewer when a stop is requested)."""
        if self.nan_effect not in NAN_EFFECTS:
            raise CaffeError("nan_effect is %r; expected 'none', 'snapshot' or 'stop'"
                             % self.nan_effect)
        start_iter, stop_iter = self.iter, self.iter + int(iters)
        self._smoothing = SmoothedLoss(self.param.average_loss, self.dtype, start_iter)
        self._snapshot_iter = None
        p = self.param
        while self.iter < stop_iter:
            if p.test_interval and self.iter % p.test_interval == 0 \
                    and (self.iter > 0 or p.test_initialization):
                if self.is_root:
                    self.test_all()
                if self.requested_early_exit:
                    break
            displaying = self._displaying()
            unlearned = self._non_finite.keep_unlearned(self.net, self.nan_effect) \
                if self.is_root else []
            loss = self.forward_backward_all()
            self._smoothing.add(loss, self.iter)
            if displaying and self.is_root:
                log.info('Iteration %d, loss = %g', self.iter, self.smoothed_loss)
                self.log_outputs(self.net, 'Train')
            found, skip = check_passes(self._non_finite, self.loss_scale, self, loss, unlearned) \
                if self.is_root else (None, False)
            if found is not None:     # once a run: FirstNonFinite finds the first only
                log.warning('Iteration %d: %s (first time); %s', self.iter, found,
                            effect_text(found, self.nan_effect))
            effect = None if found is None else self.nan_effect
            if effect == 'snapshot' and not self._non_finite.spoiled_weights:
                self.snapshot()
            elif effect == 'stop':
                self.requested_early_exit = self.stopped_on_non_finite = True
                break
            if not skip:
                self.apply_update()
            self.iter += 1
            request = self.requested_action()
            if (p.snapshot and self.iter % p.snapshot == 0 and self.is_root) or \
                    request in ('snapshot', 'snapshot_stop'):
                self.snapshot()
            if request in ('stop', 'snapshot_stop'):
                self.requested_early_exit = True
                break

    @one_at_a_time('solve')
    def solve(self, resume_file=None):
        """Train to max_iter (resuming from a solverstate if given), as ``caffe train`` does."""
        p = self.param
        log.info('Solving %s', self.net.name)
        log.info('Learning Rate Policy: %s', p.lr_policy)
        self.requested_early_exit = self.stopped_on_non_finite = False
        if self.is_root:
            self.remove_stale_snapshot_files()
        if resume_file:
            log.info('Restoring previous solver status from %s', resume_file)
            self.restore(resume_file)
        self.step(p.max_iter - self.iter)
        self._non_finite.log_skipped()
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0) and \
                self._snapshot_iter != self.iter and not self._non_finite.spoiled_weights:
            self.snapshot()
        if self.requested_early_exit:
            log.info('Optimization stopped early.')
            return
        if self._displaying():
            self._smoothing.add(self.forward_all(), self.iter)
            log.info('Iteration %d, loss = %g', self.iter, self.smoothed_loss)
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        log.info('Optimization Done.')

    @property
    def smoothed_loss(self):
        """The loss the log displays (smoothed_loss.py)."""
        return self._smoothing.value

    def requested_action(self):
        """None, 'stop' or 'snapshot': what ``action_request`` asks for now."""
        if self.action_request is None:
            return None
        action = self.action_request()
        if action not in (None, 'none') + ACTIONS:
            raise CaffeError('action_request returned %r; expected None or one of %s'
                             % (action, ', '.join(map(repr, ACTIONS))))
        return None if action == 'none' else action

    def log_outputs(self, net, which, values=None):
        """Caffe's lines of the outputs of ``net`` (net_report.py)."""
        log_net_outputs(net, which, self.dtype, values)

    # ---- testing ------------------------------------------------------------------------------
    @one_at_a_time('test_all')
    def test_all(self):
        """Run every test net; returns one {output name: mean value} per test net."""
        results = []
        for i in range(len(self.test_nets)):
            if self.requested_early_exit:
                break
            results.append(self.test(i))
        return results

    def test(self, test_net_id=0):
        log.info('Iteration %d, Testing net (#%d)', self.iter, test_net_id)
        net = self.test_nets[test_net_id]
        net.share_weights_with(self.net)
        scores = TestMeans(self.dtype, self.param.test_iter[test_net_id])
        for _ in range(scores.iters):
            request = self.requested_action()
            while request is not None:
                if request in ('snapshot', 'snapshot_stop'):
                    self.snapshot()
                if request in ('stop', 'snapshot_stop'):
                    self.requested_early_exit = True
                request = self.requested_action()
            if self.requested_early_exit:
                log.info('Test interrupted.')
                return None
            scores.add(*self.on_net_device(lambda: test_batch(
                net, self.data_sources.get(test_net_id), self.dtype)))
        if self.param.test_compute_loss:
            log.info('Test loss: %g', scores.mean_loss())
        means = scores.means()
        self.log_outputs(net, 'Test', means)
        return {k: (v.item() if v.size == 1 else v) for k, v in means.items()}

    # ---- snapshots ----------------------------------------------------------------------------
    def check_snapshot_prefix(self):
        """Fail now, not at the first snapshot, when snapshots cannot be written."""
        problem = self.prefix_problem()
        if problem:
            raise CaffeError('%s: %s' % (self.source, problem))

    def prefix_problem(self):
        """Why no snapshot can be written at the prefix (no room, another run's), or None."""
        prefix = self.param.snapshot_prefix
        problem = snapshot_prefix_problem(prefix)
        return problem or (self.prefix_lock.take(prefix) if self.param.snapshot > 0 else None)

    def hold_prefix(self):
        """Take the prefix for this run, or raise naming the run that holds it."""
        self.prefix_lock.hold(self.param.snapshot_prefix, self.source)

    @one_at_a_time('snapshot')
    def snapshot(self):
        """Write the weights and the solver state; returns their two file names. A failed
        write is a CaffeError naming the file that failed."""
        self._snapshot_iter, start = self.iter, time.perf_counter()
        self.remove_stale_snapshot_files()
        paths = self.snapshot_layout.write_snapshot(
            self.param.snapshot_prefix, self.iter,
            self.param.snapshot_format == caffe_pb2.SolverParameter.HDF5, self.current_step,
            self.rule.history)
        self.last_snapshot_seconds = time.perf_counter() - start
        return paths

    def remove_stale_snapshot_files(self):
        """Remove the temporary files that snapshots of a killed run with this prefix left."""
        self.hold_prefix()           # before touching the prefix's files, as before writing them
        for path in remove_stale_temporaries(self.param.snapshot_prefix + '_iter_'):
            log.info('Removed %s, left by an interrupted snapshot', path)

    @one_at_a_time('restore')
    def restore(self, path):
        """Continue from a ``.solverstate`` / ``.solverstate.h5`` (Caffe's or ours)."""
        restore_solver(self, os.fspath(path))

    # ---- resources ------------------------------------------------------------------------
    def close(self):
        """Release what the solver holds besides memory (the prefix; threads, if parallel)."""
        self.prefix_lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
