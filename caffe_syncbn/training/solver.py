"""The solver driver: Caffe's Solver/SGDSolver loop, its tests, logs and snapshots.

One iteration is, as in Caffe: (test nets every ``test_interval``), ``forward_backward_all``
(the callbacks' ``on_start``, clear the param diffs, ``iter_size`` forward/backward
passes, the callbacks' ``on_gradients_ready``; the mean loss), then ``apply_update``
(learning rate, clip gradients, normalize by ``iter_size``, regularize, the type's update
rule, ``w -= update``), then ``iter += 1`` and maybe a snapshot.

Where the passes and updates run is the solver's ``strategy``, the one seam between the
loop and data parallelism. ``OneNet`` (one_net.py) runs the solver's own net in the caller's
thread; ``Synchronous`` and ``Asynchronous`` (synchronous.py, asynchronous.py) run
replicas. A strategy has three methods, and uses the solver's public ones only:

- ``forward_backward_all()``: this iteration's gradients, in the diffs of the solver's
  net; the mean loss. ``Solver.accumulate`` is the ``iter_size`` loop, for every strategy.
- ``forward_all()``: the display pass after training; the loss.
- ``update(rate)``: the update of every replica at ``rate`` (``Solver.update_params``).
"""
import logging
import os

import numpy as np

from .. import caffe_pb2
from ..backend import get_array_module, to_numpy
from ..errors import CaffeError, naming, quote
from ..fillers import set_random_seed
from ..formats.atomic import remove_stale_temporaries
from ..glog import log_to_stderr_unless_configured
from ..layer import LayerContext
from ..memory_plan import MEMORY_PLANS
from ..net import Net
from ..net_sharing import holds_only_params_of
from ..netparam.layer_lines import naming_net_file
from ..netparam.solver_param import (check_net_files, copy_message, load_solver_param,
                                     test_net_params, train_net_param, upgrade_solver_param)
from .lr_policy import LearningRatePolicy
from .one_net import OneNet
from .rules import ParamUpdate, rule_class
from .smoothed_loss import SmoothedLoss
from .snapshot_layout import NetLayout, snapshot_names, snapshot_prefix_problem
from .solver_checks import NAN_EFFECTS, FirstNonFinite, check_solver_param

log = logging.getLogger('caffe_syncbn')


class Solver:
    """Caffe's solver. ``Solver(solver_prototxt_or_SolverParameter, net=None)``.

    The update rule comes from the class (``AdamSolver``) or, for ``Solver`` itself,
    from the param's ``type``. ``net``/``test_nets`` are built from the param unless given.
    ``dtype`` and ``xp`` choose the float type and backend of the nets it builds;
    ``strategy`` where the passes and updates run (see the module docstring; ``OneNet``
    unless given); ``memory_plan`` the Net's memory plan for the nets it builds (None:
    the solver file's ``memory_plan``, else 'off', which keeps every diff as pycaffe's).
    """

    rule_class = None

    def __init__(self, solver, net=None, test_nets=None, dtype=None, xp=None, strategy=None,
                 memory_plan=None):
        log_to_stderr_unless_configured()
        self.strategy = strategy or OneNet(self)
        if isinstance(solver, caffe_pb2.SolverParameter):
            self.param, self.source = upgrade_solver_param(copy_message(solver)), 'solver'
        else:
            self.source = os.fspath(solver)
            self.param = load_solver_param(self.source)
        named = rule_class(self.param.type, self.source)    # checked where a class forces one too
        self.rule_class = self.rule_class or named
        self.memory_plan = memory_plan or self.param.memory_plan or 'off'
        if self.memory_plan not in MEMORY_PLANS:        # named by the caller or by the file
            raise CaffeError('%smemory_plan %s: expected one of %s' % (
                '' if memory_plan else self.source + ': ', quote(self.memory_plan),
                ', '.join(MEMORY_PLANS)))
        self.xp = xp
        self.dtype = np.dtype(dtype or (net.context.dtype if net is not None else np.float32))
        p = self.param
        self.iter = 0
        check_solver_param(p, self.source)
        if net is None:
            check_net_files(p, self.source)
        if p.snapshot > 0 or p.snapshot_after_train:
            self.check_snapshot_prefix()
        if p.random_seed >= 0:
            set_random_seed(p.random_seed)
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
        #: called after every iteration and test batch: returns None, 'stop' or 'snapshot'
        self.action_request = None
        #: what the first non-finite loss or gradient does besides a warning: 'none' (train
        #: on, as Caffe), 'snapshot' (the weights before that update), 'stop' (end before it)
        self.nan_effect = 'none'
        self._non_finite = FirstNonFinite()
        self.requested_early_exit = False
        #: the learning rate of the last update
        self.last_rate = None
        self._smoothing = SmoothedLoss(p.average_loss, self.dtype)
        #: set_data_source's sources: {'train' or a test net's index: source}
        self.data_sources = {}
        #: (on_start, on_gradients_ready) pairs, run around each iteration's passes
        self.callbacks = []

    def _create_solver_net(self, solver_net):
        """A net the solver names; its errors name its file (and line) or the solver file."""
        param = solver_net.param
        with naming_net_file(solver_net.file, param) if solver_net.file else naming(self.source):
            return self.create_net(param, param.state.phase)

    def create_net(self, net_param, phase):
        """Build one Net (overridden by solvers that place nets on devices)."""
        context = None
        if self.xp is not None:
            context = LayerContext(phase=phase, xp=self.xp, dtype=self.dtype)
        return Net(net_param, phase, level=net_param.state.level, context=context, dtype=self.dtype,
                   memory_plan=self.memory_plan)

    def make_snapshot_layout(self):
        return NetLayout(self.net)

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

    def feed(self, net, key):
        """Put what the data source of ``key`` ('train' or a test net's index) gives into
        ``net``'s blobs (nothing without a source)."""
        source = self.data_sources.get(key)
        if source is None:
            return
        for name, value in source().items():
            if name not in net.blobs:
                raise CaffeError("data source gave blob '%s', which net '%s' does not have"
                                 % (name, net.name))
            blob = net.blobs[name]
            value = blob.xp.asarray(value, dtype=blob.dtype)
            if blob.shape != value.shape:
                blob.reshape(value.shape)
            blob.data[...] = value

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
    def step(self, iters):
        """Run ``iters`` iterations (fewer when a stop is requested)."""
        if self.nan_effect not in NAN_EFFECTS:
            raise CaffeError("nan_effect is %r; expected 'none', 'snapshot' or 'stop'"
                             % self.nan_effect)
        start_iter, stop_iter = self.iter, self.iter + int(iters)
        self._smoothing = SmoothedLoss(self.param.average_loss, self.dtype, start_iter)
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
            effect = self._non_finite_effect(loss, unlearned)
            if effect == 'snapshot':
                self.snapshot()
            elif effect == 'stop':
                self.requested_early_exit = True
                break
            self.apply_update()
            self.iter += 1
            request = self.requested_action()
            if (p.snapshot and self.iter % p.snapshot == 0 and self.is_root) or request == 'snapshot':
                self.snapshot()
            if request == 'stop':
                self.requested_early_exit = True
                break

    def solve(self, resume_file=None):
        """Train to max_iter (resuming from a solverstate if given), as ``caffe train`` does."""
        p = self.param
        log.info('Solving %s', self.net.name)
        log.info('Learning Rate Policy: %s', p.lr_policy)
        self.requested_early_exit = False
        if self.is_root:
            self.remove_stale_snapshot_files()
        if resume_file:
            log.info('Restoring previous solver status from %s', resume_file)
            self.restore(resume_file)
        self.step(p.max_iter - self.iter)
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
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

    def _non_finite_effect(self, loss, unlearned):
        """At the first non-finite loss or gradient: a warning, and ``nan_effect``."""
        what = self._non_finite.check(loss, self.net, unlearned) if self.is_root else None
        if what is None:
            return None
        log.warning('Iteration %d: %s is not finite (first time); %s', self.iter, what,
                    NAN_EFFECTS[self.nan_effect])
        return self.nan_effect

    def requested_action(self):
        """None, 'stop' or 'snapshot': what ``action_request`` asks for now."""
        if self.action_request is None:
            return None
        action = self.action_request()
        if action not in (None, 'none', 'stop', 'snapshot'):
            raise CaffeError("action_request returned %r; expected None, 'stop' or 'snapshot'" % action)
        return None if action == 'none' else action

    def log_outputs(self, net, which, values=None):
        """Caffe's '    Train net output #k: name = v (* w = w*v loss)' lines."""
        d = self.dtype.type
        index = 0
        for name in net.outputs:
            weight = net.output_blob_loss_weights.get(name, 0)
            data = values[name] if values is not None else to_numpy(net.blobs[name].data)
            for value in np.asarray(data, self.dtype).ravel():
                extra = ' (* %g = %g loss)' % (weight, d(weight) * value) if weight else ''
                log.info('    %s net output #%d: %s = %g%s', which, index, name, value, extra)
                index += 1

    # ---- testing ------------------------------------------------------------------------------
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
        iters = self.param.test_iter[test_net_id]
        d = self.dtype.type
        sums, loss = None, d(0)
        for _ in range(iters):
            request = self.requested_action()
            while request is not None:
                if request == 'snapshot':
                    self.snapshot()
                else:
                    self.requested_early_exit = True
                request = self.requested_action()
            if self.requested_early_exit:
                log.info('Test interrupted.')
                return None
            batch_loss, outputs = self.on_net_device(lambda: self._test_batch(net, test_net_id))
            if self.param.test_compute_loss:
                loss += d(batch_loss)
            sums = outputs if sums is None else {k: sums[k] + v for k, v in outputs.items()}
        if self.param.test_compute_loss:
            log.info('Test loss: %g', loss / d(max(iters, 1)))
        means = {k: v / d(iters) for k, v in (sums or {}).items()}
        self.log_outputs(net, 'Test', means)
        return {k: (v.item() if v.size == 1 else v) for k, v in means.items()}

    def _test_batch(self, net, test_net_id):
        """One batch of a test net: its loss and {output name: host array}."""
        self.feed(net, test_net_id)
        loss = net.forward_prefilled()
        return loss, {name: to_numpy(net.blobs[name].data).astype(self.dtype)
                      for name in net.outputs}

    # ---- snapshots ----------------------------------------------------------------------------
    def check_snapshot_prefix(self):
        """Fail now, not at the first snapshot, when snapshots cannot be written."""
        problem = self.prefix_problem()
        if problem:
            raise CaffeError('%s: %s' % (self.source, problem))

    def prefix_problem(self):
        """Why no snapshot can be written at the prefix, or None."""
        return snapshot_prefix_problem(self.param.snapshot_prefix)

    def snapshot(self):
        """Write the weights and the solver state; returns their two file names. A failed
        write is a CaffeError naming the file that failed."""
        hdf5 = self.param.snapshot_format == caffe_pb2.SolverParameter.HDF5
        model, state = snapshot_names(self.param.snapshot_prefix, self.iter, hdf5)
        self.remove_stale_snapshot_files()
        kind = 'HDF5' if hdf5 else 'binary proto'
        log.info('Snapshotting to %s file %s', kind, model)
        self.snapshot_layout.save(model, hdf5)
        log.info('Snapshotting solver state to %s file %s', kind, state)
        self.snapshot_layout.write_solver_state(state, self.iter, model, self.current_step,
                                                self.rule.history)
        return model, state

    def remove_stale_snapshot_files(self):
        """Remove the temporary files that snapshots of a killed run with this prefix left."""
        for path in remove_stale_temporaries(self.param.snapshot_prefix + '_iter_'):
            log.info('Removed %s, left by an interrupted snapshot', path)

    def restore(self, path):
        """Continue from a ``.solverstate`` / ``.solverstate.h5`` (Caffe's or ours)."""
        path = os.fspath(path)
        layout = self.snapshot_layout
        state, saved = layout.read_solver_state(path, self.rule.history_per_param,
                                                "a %s solver on net '%s'"
                                                % (self.param.type, self.net.name))
        self.lr_policy.check_resume(state.iter, state.current_step, path)
        self.on_net_device(lambda: self._restore_arrays(layout, state, saved, path))
        self.iter = state.iter
        self.lr_policy.current_step = state.current_step
        log.info('%s: restored iteration %d from %s', type(self).__name__, self.iter, path)

    def _restore_arrays(self, layout, state, saved, path):
        layout.load_learned_net(state.learned_net, path)
        for saved_array, mine in zip(saved, self.rule.history):
            mine[...] = get_array_module(mine).asarray(saved_array, dtype=mine.dtype)

    # ---- resources ------------------------------------------------------------------------
    def close(self):
        """Release what the solver holds besides memory (a data-parallel one: threads)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
