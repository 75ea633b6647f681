"""Caffe's learning-rate policies (SolverParameter.lr_policy).

The rate is rounded to the solver's dtype the way Caffe's float arithmetic rounds it:
``pow`` of a float base and an integer exponent runs in double precision (C++ promotes
it), the other sub-expressions in the param dtype. ``multistep`` is stateful: its
``current_step`` moves one step at a time and is saved in the solverstate.
"""
import logging
import math

import numpy as np

from ..errors import CaffeError, quote

log = logging.getLogger('caffe_syncbn')

POLICIES = ('fixed', 'step', 'exp', 'inv', 'multistep', 'poly', 'sigmoid')


class LearningRatePolicy:
    """``rate(iteration)`` as Caffe's GetLearningRate at internal iteration ``iteration``."""

    def __init__(self, solver_param, dtype=np.float32, source='solver'):
        self.param = solver_param
        self.source = source
        self.policy = solver_param.lr_policy
        self.dtype = np.dtype(dtype)
        self.current_step = 0
        self._check()

    def _check(self):
        p, policy = self.param, self.policy
        if policy not in POLICIES:
            raise CaffeError('%s: unknown lr_policy %s; expected one of %s'
                             % (self.source, quote(policy), ', '.join(POLICIES)))
        if policy in ('step', 'exp', 'inv', 'multistep', 'sigmoid') and p.gamma < 0:
            raise CaffeError("%s: lr_policy '%s' needs gamma >= 0, got %g"
                             % (self.source, policy, p.gamma))
        if policy in ('step', 'sigmoid') and p.stepsize <= 0:
            raise CaffeError("%s: lr_policy '%s' needs stepsize > 0, got %d"
                             % (self.source, policy, p.stepsize))
        if policy == 'poly' and p.max_iter <= 0:
            raise CaffeError("%s: lr_policy 'poly' needs max_iter > 0, got %d"
                             % (self.source, p.max_iter))

    def check_resume(self, iteration, current_step, source):
        """Reject a saved iteration or multistep position that no run could have reached."""
        if iteration < 0:
            raise CaffeError('%s: iteration %d is negative' % (source, iteration))
        steps = len(self.param.stepvalue) if self.policy == 'multistep' else 0
        if self.policy == 'multistep' and not 0 <= current_step <= steps:
            raise CaffeError("%s: current_step %d is outside 0..%d, the steps of lr_policy "
                             "'multistep' (%d stepvalue)" % (source, current_step, steps, steps))

    def rate(self, iteration):
        """The rate at ``iteration``; a CaffeError where the policy is undefined or overflows
        there (Caffe would go on with an infinite or NaN rate)."""
        try:
            rate = self._rate(iteration)
        except (OverflowError, ValueError, ZeroDivisionError):
            rate = float('nan')
        if not np.isfinite(rate):
            raise CaffeError("%s: lr_policy '%s' has no finite learning rate at iteration %d "
                             '(base_lr %g, gamma %g, power %g, stepsize %d, max_iter %d)'
                             % (self.source, self.policy, iteration, self.param.base_lr,
                                self.param.gamma, self.param.power, self.param.stepsize,
                                self.param.max_iter))
        return rate

    def _rate(self, iteration):
        d = self.dtype.type
        p = self.param
        base = float(d(p.base_lr))
        gamma = float(d(p.gamma))
        policy = self.policy
        if policy == 'fixed':
            return d(base)
        if policy == 'step':
            self.current_step = iteration // p.stepsize
            return d(base * gamma ** self.current_step)
        if policy == 'exp':
            return d(base * gamma ** iteration)
        if policy == 'inv':
            # gamma * iter is float (ParamSpec floats), 1 + it is Dtype
            grown = d(1) + d(np.float32(p.gamma) * np.float32(iteration))
            return d(base * math.pow(float(grown), -float(np.float32(p.power))))
        if policy == 'multistep':
            if self.current_step < len(p.stepvalue) and iteration >= p.stepvalue[self.current_step]:
                self.current_step += 1
                log.info('MultiStep Status: Iteration %d, step = %d', iteration, self.current_step)
            return d(base * gamma ** self.current_step)
        if policy == 'poly':
            remaining = d(1) - d(iteration) / d(p.max_iter)
            return d(base * math.pow(float(remaining), float(np.float32(p.power))))
        # sigmoid
        exponent = -d(p.gamma) * (d(iteration) - d(p.stepsize))
        return d(base) * (d(1) / (d(1) + np.exp(exponent)))
