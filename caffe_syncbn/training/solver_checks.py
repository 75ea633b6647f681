"""Checks of a SolverParameter done before any net is built: settings Caffe would abort on."""
import logging
import os

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
    if p.snapshot > 0:
        if not p.HasField('snapshot_prefix'):
            raise CaffeError('%s: snapshot is set but snapshot_prefix is not' % source)
        probe = '%s_iter_0.tempfile' % p.snapshot_prefix
        try:
            open(probe, 'w').close()
            os.remove(probe)
        except OSError:
            raise CaffeError("%s: cannot write to snapshot prefix '%s'; make sure its folder "
                             'exists and is writable' % (source, p.snapshot_prefix)) from None


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
