"""Checks of a solver's run: the SolverParameter before any net is built (settings Caffe
would abort on), and the first non-finite loss or gradient as it trains."""
import logging

import numpy as np

from ..errors import CaffeError, quote

log = logging.getLogger('caffe_syncbn')


def check_solver_param(p, source):
    """Reject settings Caffe would abort on (here before any net is built)."""
    if p.average_loss < 1:
        raise CaffeError('%s: average_loss must be >= 1, got %d' % (source, p.average_loss))
    if p.iter_size < 1:
        raise CaffeError('%s: iter_size must be >= 1, got %d' % (source, p.iter_size))
    if p.regularization_type not in ('L1', 'L2'):
        raise CaffeError("%s: unknown regularization_type %s; expected 'L1' or 'L2'"
                         % (source, quote(p.regularization_type)))
    if p.snapshot_diff:
        log.warning('%s: snapshot_diff is not supported; snapshots hold the weights only', source)
    if p.snapshot > 0 and not p.HasField('snapshot_prefix'):
        raise CaffeError('%s: snapshot is set but snapshot_prefix is not' % source)


def non_finite(loss, net):
    """What is not finite, the loss or the gradient of a param (named), or None. The sum of
    every gradient is one pass over them, and is finite exactly when they all are (short of
    an overflow, which would itself be a blow-up)."""
    if not np.isfinite(loss):
        return 'the loss (%g)' % loss
    sums = [blob.diff.sum(dtype=np.promote_types(blob.dtype, np.float32))
            for blob in net.learnable_params]
    if np.isfinite(float(sum(sums))):
        return None
    for name, params in net.params.items():
        for j, blob in enumerate(params):
            if not bool(blob.xp.isfinite(blob.diff).all()):
                return "the gradient of layer '%s' (param %d)" % (name, j)
    return 'a gradient'


#: what each ``nan_effect`` does at the first non-finite loss or gradient, as the log says it
NAN_EFFECTS = {
    'none': 'training goes on, as in Caffe (-nan_effect snapshot or stop would save the '
            'weights before this update)',
    'snapshot': 'snapshotting the weights before this update; training goes on',
    'stop': 'training stops before this update, as on a stop signal'}


class FirstNonFinite:
    """The first non-finite loss or gradient of a run, found once."""

    def __init__(self):
        self.seen = False

    def keep_unlearned(self, net, nan_effect):
        """While ``nan_effect`` wants a snapshot at the first non-finite: copies of the params
        no update changes (running statistics, frozen layers), which forward may spoil."""
        if nan_effect == 'none' or self.seen:
            return []
        return [(blob, blob.data.copy()) for blob, lr in
                zip(net.learnable_params, net.params_lr) if lr == 0]

    def check(self, loss, net, unlearned):
        """What is not finite the first time (see non_finite), or None; the params of
        ``unlearned`` (keep_unlearned) are then put back as they were before the passes."""
        if self.seen:
            return None
        what = non_finite(loss, net)
        if what is None:
            return None
        self.seen = True
        for blob, before in unlearned:
            blob.data[...] = before
        return what
