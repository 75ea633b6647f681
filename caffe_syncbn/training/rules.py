"""Caffe's update of the params: ``ParamUpdate`` (clip, normalize, regularize, the rule,
``w -= update``) and the update rules, the ComputeUpdateValue step of each solver type.

``@solver_type('Adam')`` registers a rule as the solver type its SolverParameter ``type``
names: the types a solver file may name, pycaffe's solver classes (``AdamSolver``) and the
errors that list the types all come from this registry, in the order the rules register
(Caffe's: SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam).

A rule owns the history arrays of every learnable param, in Caffe's order (the order
the solverstate stores them in), and turns a param's (normalized, regularized)
gradient in ``blob.diff`` into the update that the solver then subtracts from
``blob.data``. Arithmetic follows Caffe's, step by step, in the param dtype: the
scalars are dtype scalars, so float32 nets round as Caffe's float code does.
"""
import math

import numpy as np

from ..errors import CaffeError, quote

#: {SolverParameter.type: its update rule class}, in the order the types registered
RULES = {}


def solver_type(type_name):
    """Register an UpdateRule subclass as the solver type ``type_name``."""
    def register(rule):
        if type_name in RULES:
            raise ValueError('solver type %s is registered twice (%s and %s)'
                             % (type_name, RULES[type_name].__name__, rule.__name__))
        rule.type_name = type_name
        RULES[type_name] = rule
        return rule
    return register


class UpdateRule:
    #: SolverParameter.type, set by @solver_type
    type_name = None
    #: how many history arrays each param has (Adam and AdaDelta keep two)
    history_per_param = 1

    def __init__(self, solver_param, params, lr_mults, dtype=None):
        self.param = solver_param
        self.lr_mults = list(lr_mults)
        self.dtype = np.dtype(dtype or (params[0].dtype if params else np.float32))
        d = self.dtype.type
        self.momentum = d(solver_param.momentum)
        self.delta = d(solver_param.delta)
        self.check()
        # Caffe's history order: the first set for every param, then the second set.
        self.history = [blob.xp.zeros(blob.shape, self.dtype)
                        for _ in range(self.history_per_param) for blob in params]
        self.num_params = len(params)

    def check(self):
        """Raise for settings this solver type rejects."""

    def local_rate(self, i, rate):
        d = self.dtype.type
        return d(rate) * d(self.lr_mults[i])

    def compute_update(self, i, blob, rate, iteration=0):
        """Replace ``blob.diff`` (param ``i``'s gradient) with its update."""
        raise NotImplementedError


@solver_type('SGD')
class SGDRule(UpdateRule):
    """v = momentum * v + lr * g; the update is v."""

    def compute_update(self, i, blob, rate, iteration=0):
        history = self.history[i]
        history *= self.momentum
        history += self.local_rate(i, rate) * blob.diff
        blob.diff[...] = history


@solver_type('Nesterov')
class NesterovRule(UpdateRule):
    """Step back along the old velocity, then over-step along the new one."""

    def compute_update(self, i, blob, rate, iteration=0):
        history = self.history[i]
        previous = history.copy()
        history *= self.momentum
        history += self.local_rate(i, rate) * blob.diff
        d = self.dtype.type
        blob.diff[...] = (d(1) + self.momentum) * history - self.momentum * previous


class _NoMomentumRule(UpdateRule):
    def check(self):
        if self.param.momentum != 0:
            raise CaffeError('momentum cannot be used with %s (got momentum %g); remove it'
                             % (self.type_name, self.param.momentum))


@solver_type('AdaGrad')
class AdaGradRule(_NoMomentumRule):
    """h += g^2; update = lr * g / (sqrt(h) + delta)."""

    def compute_update(self, i, blob, rate, iteration=0):
        history, grad = self.history[i], blob.diff
        history += grad * grad
        blob.diff[...] = self.local_rate(i, rate) * (grad / (blob.xp.sqrt(history) + self.delta))


@solver_type('RMSProp')
class RMSPropRule(_NoMomentumRule):
    """h = decay * h + (1 - decay) * g^2; update = lr * g / (sqrt(h) + delta)."""

    def check(self):
        super().check()
        if not 0 <= self.param.rms_decay < 1:
            raise CaffeError('RMSProp needs 0 <= rms_decay < 1, got %g' % self.param.rms_decay)

    def compute_update(self, i, blob, rate, iteration=0):
        d = self.dtype.type
        decay = d(self.param.rms_decay)
        history, grad = self.history[i], blob.diff
        history *= decay
        history += (d(1) - decay) * (grad * grad)
        blob.diff[...] = self.local_rate(i, rate) * (grad / (blob.xp.sqrt(history) + self.delta))


@solver_type('AdaDelta')
class AdaDeltaRule(UpdateRule):
    """Zeiler's AdaDelta; history[i] is E[g^2], history[N + i] is E[dx^2] (without the lr)."""
    history_per_param = 2

    def compute_update(self, i, blob, rate, iteration=0):
        d = self.dtype.type
        xp, grad = blob.xp, blob.diff
        mean_grad_sq = self.history[i]
        mean_step_sq = self.history[self.num_params + i]
        keep, mix = self.momentum, d(1) - self.momentum
        mean_grad_sq *= keep
        mean_grad_sq += mix * (grad * grad)
        step = grad * xp.sqrt((mean_step_sq + self.delta) / (mean_grad_sq + self.delta))
        mean_step_sq *= keep
        mean_step_sq += mix * (step * step)
        blob.diff[...] = self.local_rate(i, rate) * step


@solver_type('Adam')
class AdamRule(UpdateRule):
    """Adam; history[i] is the first moment m, history[N + i] the second moment v."""
    history_per_param = 2

    def check(self):
        p = self.param
        if not (0 <= p.momentum < 1 and 0 <= p.momentum2 < 1):
            raise CaffeError('Adam needs 0 <= momentum < 1 and 0 <= momentum2 < 1, got %g and %g'
                             % (p.momentum, p.momentum2))

    def compute_update(self, i, blob, rate, iteration=0):
        d = self.dtype.type
        xp, grad = blob.xp, blob.diff
        beta1, beta2 = self.momentum, d(self.param.momentum2)
        t = iteration + 1
        # Caffe computes pow(beta, t) in double precision, then rounds the correction.
        correction = d(math.sqrt(1.0 - float(beta2) ** t) / (1.0 - float(beta1) ** t))
        first = self.history[i]
        second = self.history[self.num_params + i]
        first *= beta1
        first += (d(1) - beta1) * grad
        second *= beta2
        second += (d(1) - beta2) * (grad * grad)
        blob.diff[...] = (self.local_rate(i, rate) * correction) * (first / (xp.sqrt(second) + self.delta))


def rule_class(type_name, source=None):
    """The update rule of a SolverParameter ``type`` ('SGD', 'Adam', ...); for a type no rule
    registered, the one error that lists those that did (naming ``source``, the solver
    file, when given)."""
    try:
        return RULES[type_name]
    except KeyError:
        raise CaffeError('%sunknown solver type %s; expected one of %s'
                         % (source + ': ' if source else '', quote(type_name), ', '.join(RULES))) \
            from None


class ParamUpdate:
    """What Caffe's SGDSolver::ApplyUpdate does after choosing the rate, to the learnable
    params of ``net``: clip the gradients, normalize them by ``iter_size``, regularize,
    the rule's update (``rule``, with its history), ``w -= update``."""

    def __init__(self, solver_param, net, rule_class, dtype):
        self.param, self.net, self.dtype = solver_param, net, np.dtype(dtype)
        self.rule = rule_class(solver_param, net.learnable_params, net.params_lr, self.dtype)

    def apply(self, rate, iteration):
        """Update the params; (L2 norm, clip_gradients, scale factor) when the gradients
        were clipped, else None. The diffs hold the gradients times the net's loss scale
        (training/loss_scale.py), which comes off first."""
        self.unscale()
        clipped = self.clip_gradients()
        params = self.net.learnable_params
        for i, blob in enumerate(params):
            self.normalize(blob)
            self.regularize(i, blob)
            self.rule.compute_update(i, blob, rate, iteration)
        for blob in params:
            blob.data -= blob.diff
        return clipped

    def unscale(self):
        """Divide the diffs by the net's loss scale (a power of two: exact in float32)."""
        if self.net.loss_scale != 1:
            factor = self.dtype.type(1.0 / self.net.loss_scale)
            for blob in self.net.learnable_params:
                blob.diff *= factor

    def clip_gradients(self):
        """Scale all diffs down when their global L2 norm exceeds clip_gradients; (L2 norm,
        clip_gradients, scale factor) when it does, else None."""
        clip = self.param.clip_gradients
        if clip < 0:
            return None
        d = self.dtype.type
        params = self.net.learnable_params
        sumsq = d(0)
        for blob in params:
            sumsq += d(float((blob.diff * blob.diff).sum()))
        norm = np.sqrt(sumsq)
        if norm <= d(clip):
            return None
        factor = d(clip) / norm
        for blob in params:
            blob.diff *= factor
        return norm, clip, factor

    def normalize(self, blob):
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
