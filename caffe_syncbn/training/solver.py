"""The solver driver: Caffe's Solver/SGDSolver loop, its tests, logs and snapshots.

One iteration is, as in Caffe: (test nets every ``test_interval``), ``forward_backward_all``
(clear the param diffs, ``iter_size`` forward/backward passes, mean loss), then
``apply_update`` (learning rate, clip gradients, normalize by ``iter_size``,
regularize, the type's update rule, ``w -= update``), then ``iter += 1`` and maybe a
snapshot. The data-parallel solver overrides ``forward_backward_all`` to run every
replica and average their gradients, and calls ``apply_update`` on each replica.
"""
import logging
import os

import numpy as np

from .. import caffe_pb2
from ..backend import get_array_module, to_numpy
from ..errors import CaffeError, naming, quote
from ..fillers import set_random_seed
from ..formats.atomic import remove_stale_temporaries
from ..formats.solverstate import SolverState, read_solver_state, write_solver_state
from ..layer import LayerContext
from ..net import Net
from ..netparam.solver_param import (copy_message, load_solver_param, test_net_params,
                                     train_net_param, upgrade_solver_param)
from .lr_policy import LearningRatePolicy
from .rules import RULES
from .snapshot_layout import NetTerms
from .solver_checks import check_solver_param, non_finite

log = logging.getLogger('caffe_syncbn')


class Solver:
    """Caffe's solver. ``Solver(solver_prototxt_or_SolverParameter, net=None)``.

    The update rule comes from the class (``AdamSolver``) or, for ``Solver`` itself,
    from the param's ``type``. ``net``/``test_nets`` are built from the param unless given.
    ``dtype`` and ``xp`` choose the float type and backend of the nets it builds.
    """

    rule_class = None

    def __init__(self, solver, net=None, test_nets=None, dtype=None, xp=None):
        if isinstance(solver, caffe_pb2.SolverParameter):
            self.param = upgrade_solver_param(copy_message(solver))
            self.source = 'solver'
        else:
            self.source = os.fspath(solver)
            self.param = load_solver_param(self.source)
        self.xp = xp
        self.dtype = np.dtype(dtype or (net.context.dtype if net is not None else np.float32))
        p = self.param
        self.rule_class = self.rule_class or _rule_class(p.type)
        self.iter = 0
        check_solver_param(p, self.source)
        if p.random_seed >= 0:
            set_random_seed(p.random_seed)
        if net is None:
            train_param = train_net_param(p, self.source)
            with naming(self.source):
                net = self.create_net(train_param, train_param.state.phase)
        self.net = net
        #: the terms its files speak: the net's own, or the user's prototxt (convert.terms)
        self.file_terms = self.make_file_terms()
        self._load_weights(net)
        if test_nets is None:
            with naming(self.source):
                test_nets = [self.create_net(n, n.state.phase)
                             for n in test_net_params(p, self.source)]
        elif len(p.test_iter) < len(test_nets):
            raise CaffeError('%s: test_iter must be given once per test net (%d test_iter for %d '
                             'test nets)' % (self.source, len(p.test_iter), len(test_nets)))
        self.test_nets = list(test_nets)
        for test_net in self.test_nets:
            self._load_weights(test_net)
            test_net.share_weights_with(self.net)
        self.lr_policy = LearningRatePolicy(p, self.dtype, self.source)
        with naming(self.source):
            self.rule = self.rule_class(p, self.net.learnable_params, self.net.params_lr,
                                        self.dtype)
        #: Caffe's root_solver(): only the root logs, tests and snapshots
        self.is_root = True
        #: called after every iteration and test batch: returns None, 'stop' or 'snapshot'
        self.action_request = None
        #: what the first non-finite loss or gradient does besides a warning: 'none' (train
        #: on, as Caffe), 'snapshot' (the weights before that update), 'stop' (end before it)
        self.nan_effect = 'none'
        self._warned_non_finite = False
        self.requested_early_exit = False
        self.smoothed_loss = 0.0
        #: the learning rate of the last update
        self.last_rate = None
        self._losses = []
        self._data_sources = {}

    def create_net(self, net_param, phase):
        """Build one Net (overridden by solvers that place nets on devices)."""
        context = None
        if self.xp is not None:
            context = LayerContext(phase=phase, xp=self.xp, dtype=self.dtype)
        return Net(net_param, phase, level=net_param.state.level, context=context, dtype=self.dtype)

    def make_file_terms(self):
        return NetTerms(self.net)

    def _load_weights(self, net):
        """The solver's ``weights`` entries (each a comma-separated list), as Caffe finetunes."""
        for entry in self.param.weights:
            for path in (name.strip() for name in entry.split(',')):
                if path:
                    log.info('Finetuning from %s', path)
                    self.file_terms.load_weights(net, path)

    # ---- data -------------------------------------------------------------------------------
    def set_data_source(self, source, test_net=None):
        """Feed Input blobs: ``source()`` returns {blob name: array} before every forward.

        ``test_net=None`` feeds the train net, an index feeds that test net.
        """
        self._data_sources['train' if test_net is None else int(test_net)] = source

    def _feed(self, net, key):
        source = self._data_sources.get(key)
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
    def forward_backward_all(self):
        """Clear the param diffs, run ``iter_size`` forward/backward passes, return the mean loss."""
        d = self.dtype.type
        self.net.clear_param_diffs()
        loss = d(0)
        for _ in range(self.param.iter_size):
            self._feed(self.net, 'train')
            loss += d(self.net.forward_backward())
        return float(loss / d(self.param.iter_size))

    def forward_all(self):
        """A forward pass only (the display pass after training); returns the loss."""
        self._feed(self.net, 'train')
        return self.net.forward_prefilled()

    def learning_rate(self):
        return self.lr_policy.rate(self.iter)

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
        self.update_params(rate)
        return rate

    def update_params(self, rate):
        """Clip, normalize and regularize the diffs, and apply the update rule at ``rate``."""
        self.clip_gradients()
        params = self.net.learnable_params
        for i, blob in enumerate(params):
            self.normalize(i, blob)
            self.regularize(i, blob)
            self.rule.compute_update(i, blob, rate, self.iter)
        for blob in params:
            blob.data -= blob.diff

    def clip_gradients(self):
        """Scale all diffs down when their global L2 norm exceeds clip_gradients."""
        clip = self.param.clip_gradients
        if clip < 0:
            return
        d = self.dtype.type
        params = self.net.learnable_params
        sumsq = d(0)
        for blob in params:
            sumsq += d(float((blob.diff * blob.diff).sum()))
        norm = np.sqrt(sumsq)
        if norm > d(clip):
            factor = d(clip) / norm
            if self.is_root:
                log.info('Gradient clipping: scaling down gradients (L2 norm %g > %g) by scale factor %g',
                         norm, clip, factor)
            for blob in params:
                blob.diff *= factor

    def normalize(self, i, blob):
        """Average the diffs accumulated over iter_size passes."""
        if self.param.iter_size > 1:
            d = self.dtype.type
            blob.diff *= d(1) / d(self.param.iter_size)

    def regularize(self, i, blob):
        d = self.dtype.type
        decay = d(self.param.weight_decay) * d(self.net.params_weight_decay[i])
        if not decay:
            return
        if self.param.regularization_type == 'L2':
            blob.diff += decay * blob.data
        else:
            blob.diff += decay * blob.xp.sign(blob.data)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self, iters):
        """Run ``iters`` iterations (fewer when a stop is requested)."""
        if self.nan_effect not in ('none', 'snapshot', 'stop'):
            raise CaffeError("nan_effect is %r; expected 'none', 'snapshot' or 'stop'"
                             % self.nan_effect)
        start_iter, stop_iter = self.iter, self.iter + int(iters)
        self._losses, self.smoothed_loss = [], 0.0
        p = self.param
        while self.iter < stop_iter:
            if p.test_interval and self.iter % p.test_interval == 0 \
                    and (self.iter > 0 or p.test_initialization):
                if self.is_root:
                    self.test_all()
                if self.requested_early_exit:
                    break
            displaying = self._displaying()
            unlearned = self._unlearned_copies()
            loss = self.forward_backward_all()
            self._update_smoothed_loss(loss, start_iter)
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
            request = self._requested_action()
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
        start_iter = self.iter
        self.step(p.max_iter - self.iter)
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
            self.snapshot()
        if self.requested_early_exit:
            log.info('Optimization stopped early.')
            return
        if self._displaying():
            self._update_smoothed_loss(self.forward_all(), start_iter)
            log.info('Iteration %d, loss = %g', self.iter, self.smoothed_loss)
        if p.test_interval and self.iter % p.test_interval == 0:
            self.test_all()
        log.info('Optimization Done.')

    def _update_smoothed_loss(self, loss, start_iter):
        d = self.dtype.type
        average, loss = self.param.average_loss, d(loss)
        if len(self._losses) < average:
            self._losses.append(loss)
            n = len(self._losses)
            self.smoothed_loss = float((d(self.smoothed_loss) * d(n - 1) + loss) / d(n))
        else:
            slot = (self.iter - start_iter) % average
            self.smoothed_loss = float(d(self.smoothed_loss) + (loss - self._losses[slot]) / d(average))
            self._losses[slot] = loss

    def _unlearned_copies(self):
        """While ``nan_effect`` wants a snapshot at the first non-finite: copies of the params
        no update changes (running statistics, frozen layers), which forward may spoil."""
        if self.nan_effect == 'none' or self._warned_non_finite or not self.is_root:
            return []
        return [(blob, blob.data.copy()) for blob, lr in
                zip(self.net.learnable_params, self.net.params_lr) if lr == 0]

    def _non_finite_effect(self, loss, unlearned):
        """At the first non-finite loss or gradient: a warning, and ``nan_effect``, which
        snapshots the params as they were before (``unlearned`` puts back the statistics)."""
        if self._warned_non_finite or not self.is_root:
            return None
        what = non_finite(loss, self.net)
        if what is None:
            return None
        self._warned_non_finite = True
        log.warning('Iteration %d: %s is not finite (first time); %s', self.iter, what, {
            'none': 'training goes on, as in Caffe (-nan_effect snapshot or stop would save '
                    'the weights before this update)',
            'snapshot': 'snapshotting the weights before this update; training goes on',
            'stop': 'training stops before this update, as on a stop signal'}[self.nan_effect])
        for blob, before in unlearned:
            blob.data[...] = before
        return self.nan_effect

    def _requested_action(self):
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
            request = self._requested_action()
            while request is not None:
                if request == 'snapshot':
                    self.snapshot()
                else:
                    self.requested_early_exit = True
                request = self._requested_action()
            if self.requested_early_exit:
                log.info('Test interrupted.')
                return None
            self._feed(net, test_net_id)
            batch_loss = net.forward_prefilled()
            if self.param.test_compute_loss:
                loss += d(batch_loss)
            outputs = {name: to_numpy(net.blobs[name].data).astype(self.dtype) for name in net.outputs}
            sums = outputs if sums is None else {k: sums[k] + v for k, v in outputs.items()}
        if self.param.test_compute_loss:
            log.info('Test loss: %g', loss / d(max(iters, 1)))
        means = {k: v / d(iters) for k, v in (sums or {}).items()}
        self.log_outputs(net, 'Test', means)
        return {k: (v.item() if v.size == 1 else v) for k, v in means.items()}

    # ---- snapshots ----------------------------------------------------------------------------
    def snapshot_filename(self, extension):
        return '%s_iter_%d%s' % (self.param.snapshot_prefix, self.iter, extension)

    def snapshot(self):
        """Write the weights and the solver state; returns their two file names. A failed
        write is a CaffeError naming the file that failed."""
        hdf5 = self.param.snapshot_format == caffe_pb2.SolverParameter.HDF5
        model = self.snapshot_filename('.caffemodel.h5' if hdf5 else '.caffemodel')
        state = self.snapshot_filename('.solverstate.h5' if hdf5 else '.solverstate')
        self.remove_stale_snapshot_files()
        kind = 'HDF5' if hdf5 else 'binary proto'
        log.info('Snapshotting to %s file %s', kind, model)
        self.file_terms.save(model, hdf5)
        log.info('Snapshotting solver state to %s file %s', kind, state)
        write_solver_state(state, self.solver_state(model))
        return model, state

    def remove_stale_snapshot_files(self):
        """Remove the temporary files that snapshots of a killed run with this prefix left."""
        for path in remove_stale_temporaries(self.param.snapshot_prefix + '_iter_'):
            log.info('Removed %s, left by an interrupted snapshot', path)

    def solver_state(self, learned_net=''):
        """The SolverState a snapshot writes: the history in the terms of ``file_terms``."""
        history = self.file_terms.history_out(self.rule.history)
        return SolverState(self.iter, learned_net, self.current_step, history)

    def restore(self, path):
        """Continue from a ``.solverstate`` / ``.solverstate.h5`` (Caffe's or ours)."""
        path = os.fspath(path)
        state = read_solver_state(path)
        history = self.rule.history
        saved = self.file_terms.history_in(
            state.history, path, self.rule.history_per_param,
            "a %s solver on net '%s'" % (self.param.type, self.net.name))
        self.lr_policy.check_resume(state.iter, state.current_step, path)
        if state.learned_net:
            weights = _find_learned_net(state.learned_net, path)
            try:                          # a snapshot of this net holds all of its weights
                self.file_terms.load_weights(self.net, weights, complete=True)
            except CaffeError as exc:
                raise CaffeError('solver state %s: %s' % (path, exc)) from None
        self.iter = state.iter
        self.lr_policy.current_step = state.current_step
        for saved_array, mine in zip(saved, history):
            mine[...] = get_array_module(mine).asarray(saved_array, dtype=mine.dtype)
        log.info('%s: restored iteration %d from %s', type(self).__name__, self.iter, path)


def _find_learned_net(name, state_path):
    """Caffe opens learned_net relative to the current directory; fall back to the state's folder."""
    if os.path.isabs(name) or os.path.exists(name):
        return name
    beside = os.path.join(os.path.dirname(os.path.abspath(state_path)), name)
    if os.path.exists(beside):
        return beside
    raise CaffeError('solver state %s names weights %s, found neither in %s nor next to the state'
                     % (state_path, quote(name), os.getcwd()))


def _rule_class(type_name):
    try:
        return RULES[type_name]
    except KeyError:
        raise CaffeError('unknown solver type %s; expected one of %s'
                         % (quote(type_name), ', '.join(RULES))) from None
