"""Caffe's learning-rate policies (SolverParameter.lr_policy).

The rate is rounded to the solver's dtype the way Caffe's float arithmetic rounds it:
``pow`` of a float base and an integer exponent runs in double precision (C++ promotes
it), the other sub-expressions in the param dtype. ``multistep`` is stateful: its
``current_step`` moves one step at a time and is saved in the solverstate.
"""
import logging
import math

import numpy as np

from ..errors import CaffeError

log = logging.getLogger('caffe_syncbn')

POLICIES = ('fixed', 'step', 'exp', 'inv', 'multistep', 'poly', 'sigmoid')


class LearningRatePolicy:
    """``rate(iteration)`` as Caffe's GetLearningRate at internal iteration ``iteration``."""

    def __init__(self, solver_param, dtype=np.float32):
        self.param = solver_param
        self.policy = solver_param.lr_policy
        self.dtype = np.dtype(dtype)
        self.current_step = 0
        self._check()

    def _check(self):
        p, policy = self.param, self.policy
        if policy not in POLICIES:
            raise CaffeError('unknown lr_policy %r; expected one of %s'
                             % (policy, ', '.join(POLICIES)))
        if policy in ('step', 'exp', 'inv', 'multistep', 'sigmoid') and p.gamma < 0:
            raise CaffeError('lr_policy %r needs gamma >= 0, got %g' % (policy, p.gamma))
        if policy in ('step', 'sigmoid') and p.stepsize <= 0:
            raise CaffeError('lr_policy %r needs stepsize > 0, got %d' % (policy, p.stepsize))
        if policy == 'poly' and p.max_iter <= 0:
            raise CaffeError("lr_policy 'poly' needs max_iter > 0, got %d" % p.max_iter)

    def rate(self, iteration):
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
