"""Dynamic loss scaling of a float16 run (``-precision float16``).

float16 holds magnitudes from 6e-8 (subnormal) to 65504: the small gradients of deep
layers fall below that range and flush to zero. The loss layers' top diffs (the loss
weights, where the backward starts) are multiplied by the scale, so every diff of the
backward is the gradient times the scale; the params' float32 diffs are divided by it
again before the update (rules.ParamUpdate), which then sees the true gradient. A scale
too large for a batch makes some diff overflow to inf: the iteration's update is skipped
(its passes' gradients are not finite, checked once per iteration with the solver's other
checks) and the scale halves; after ``growth_interval`` updates in a row without one, it
doubles. Every replica scales alike and sees the same averaged gradients, so all skip
together, in every process.

bfloat16 has float32's range: its runs, and float32's, keep the scale at 1 and never
skip (a gradient that is not finite then goes to -nan_effect, as in Caffe).
"""
import logging

log = logging.getLogger('caffe_syncbn')

#: PyTorch's GradScaler's and apex's defaults, which suit most nets: the scale starts at
#: 2^16 and doubles after 2000 updates without an overflow
INITIAL_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 2000
#: below 1 the scale would shrink gradients that are already in range
FLOOR = 1.0


class LossScale:
    """The loss scale of a run in ``precision`` (see the module docstring): ``value`` the
    factor the loss weights carry now; ``skipped`` the updates skipped so far."""

    def __init__(self, precision, initial=INITIAL_SCALE, growth_interval=GROWTH_INTERVAL):
        self.precision = precision
        self.dynamic = precision == 'float16'
        self.value = float(initial) if self.dynamic else 1.0
        self.growth_interval = growth_interval
        self.good_updates = self.skipped = 0

    def start_line(self):
        """What the log says of a mixed precision and its scale as training starts, or None
        in float32."""
        if self.precision == 'float32':
            return None
        return ('Mixed precision %s: activations and their diffs in %s; params, updates, '
                'batch-norm statistics and allreduces in float32; %s' % (
                    self.precision, self.precision,
                    'dynamic loss scale %g (halved at each update skipped for gradients that '
                    'are not finite, doubled after %d updates without one)'
                    % (self.value, self.growth_interval) if self.dynamic else
                    "no loss scale (bfloat16 has float32's range)"))

    @property
    def at_floor(self):
        """Whether the scale can go no lower: gradients that are still not finite are not
        an overflow of the scaling, and -nan_effect takes them as in float32."""
        return self.value <= FLOOR

    def skips(self, iteration, gradients_finite, loss):
        """Whether iteration ``iteration``'s update is skipped: its gradients are not finite
        (``gradients_finite`` False); the scale halves, or doubles after growth_interval
        good updates. Logs both."""
        if not self.dynamic:
            return False
        if gradients_finite:
            self.good_updates += 1
            if self.good_updates >= self.growth_interval:
                self.good_updates = 0
                self.value *= 2
                log.info('Iteration %d: loss scale raised to %g after %d updates without an '
                         'overflow', iteration, self.value, self.growth_interval)
            return False
        self.good_updates = 0
        self.skipped += 1
        before, self.value = self.value, max(self.value / 2, FLOOR)
        why = ('the loss (%g) is not finite: the forward overflowed float16 or the data is not '
               'finite' % loss if loss != loss or abs(loss) == float('inf') else
               'the gradients are not finite at loss scale %g (a float16 diff overflowed)'
               % before)
        log.warning('Iteration %d: update skipped (%d so far): %s; loss scale now %g%s',
                    iteration, self.skipped, why, self.value,
                    ' (its floor: see -nan_effect)' if before <= FLOOR else '')
        return True
