"""Checks of a solver's run: the SolverParameter before any net is built (settings Caffe
would abort on), and the first value that is not finite as it trains: the loss, a
gradient, a learned param, a running statistic, or the batch statistics of a SyncBN, which
then kept its running statistics (each such skipped update is logged, and counted at the
end of the run)."""
import logging

import numpy as np

from ..backend import to_numpy
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


#: the kinds of arrays watched besides the loss, in the order the check names them: the
#: learned params (as the last update left them: the pass started from them), their
#: gradients, and the params no update changes (running statistics, frozen layers)
WATCHED = (('weights', True, 'data'), ('gradient', True, 'diff'), ('statistics', False, 'data'))


class Finding:
    """A value that is not finite: ``what`` names it for the log (``plural`` for the verb);
    ``in_weights``: a learned param, which the last update spoiled, so that no weights from
    before it are left."""

    def __init__(self, what, in_weights=False, plural=False):
        self.what, self.in_weights, self.plural = what, in_weights, plural

    def __str__(self):
        return '%s %s not finite' % (self.what, 'are' if self.plural else 'is')


def take_skipped(net):
    """How many running-statistics updates each layer of ``net`` skipped since the last call
    (Layer.skipped_statistics), as floats in layer order; their counts start again."""
    counts = np.array([layer.skipped_statistics for layer in net.layers], np.float64)
    for layer in net.layers:
        if layer.skipped_statistics:
            layer.skipped_statistics = 0
    return counts


def skipped_by_layer(net, counts, group_size, updates):
    """{layer name: (updates skipped, of ``updates``)} from ``counts`` (take_skipped's, summed
    over the replicas): the replicas of a group skip together, so each group's skip counts
    ``group_size`` times."""
    return {layer.name: (int(round(count / group_size)), updates)
            for layer, count in zip(net.layers, counts) if count}


def skipped_text(name, skipped, updates):
    """The warning of one layer's skipped update(s)."""
    which = '' if updates == 1 else ' in %d of its %d updates (one per group and pass)' % (
        skipped, updates)
    return ("layer '%s' kept its running statistics%s: the statistics of the batch are not "
            'finite' % (name, which))


def watched_sums(net):
    """The sum of each kind of WATCHED arrays, on the host: finite exactly when all its
    arrays are (short of an overflow, which the search that follows a sum that is not finds
    to be none); one pass over each, and one read of the device for all three."""
    groups = [[getattr(blob, field) for blob, lr in zip(net.learnable_params, net.params_lr)
               if (lr != 0) == learned] for _, learned, field in WATCHED]
    if not net.learnable_params:
        return np.zeros(len(WATCHED))
    xp = net.learnable_params[0].xp
    return to_numpy(xp.stack([xp.asarray(sum(
        (a.sum(dtype=np.promote_types(a.dtype, np.float32)) for a in group),
        start=xp.asarray(0.0)), dtype=np.float64) for group in groups]))


def non_finite(loss, net, sums=None, gradients=True, skipped=None):
    """The first value of the pass that is not finite (a Finding), or None: a learned param,
    the loss, a gradient (unless ``gradients`` is False: a loss scale takes them), the batch
    statistics of a SyncBN (``skipped``: skipped_by_layer's), then a param that no update
    changes; ``sums`` are watched_sums(net), read once."""
    sums = watched_sums(net) if sums is None else sums
    found = [_locate(net, kind, learned, field) if not np.isfinite(total) else None
             for (kind, learned, field), total in zip(WATCHED, sums)]
    if found[0] is not None:
        return found[0]
    if not np.isfinite(loss):
        return Finding('the loss (%g)' % loss)
    if found[1] is None and skipped:
        return Finding("the batch statistics of layer '%s' (which kept its running statistics)"
                       % next(iter(skipped)), plural=True)
    return (found[1] if gradients else None) or found[2]


def _locate(net, kind, learned, field):
    """The Finding of the first param of ``kind`` whose ``field`` is not finite, or None."""
    lr_of = {id(blob): lr for blob, lr in zip(net.learnable_params, net.params_lr)}
    for name, params in net.params.items():
        for j, blob in enumerate(params):
            lr = lr_of.get(id(blob))
            if lr is None or (lr != 0) != learned:
                continue                 # shared from another layer, or another kind
            if bool(blob.xp.isfinite(getattr(blob, field)).all()):
                continue
            if kind != 'statistics':
                return Finding("the %s of layer '%s' (param %d)" % (kind, name, j),
                               in_weights=kind == 'weights', plural=kind == 'weights')
            fixed = net.layer_by_name[name].fixed_param_mults(j)
            if fixed is not None and fixed[0] == 0:
                return Finding("the running statistics of layer '%s' (param %d)" % (name, j),
                               plural=True)
            return Finding("the frozen param %d of layer '%s' (lr_mult 0)" % (j, name))
    return None


#: what each ``nan_effect`` does at the first value that is not finite, as the log says it
NAN_EFFECTS = {
    'none': 'training goes on, as in Caffe (-nan_effect snapshot or stop would save the '
            'weights before this update)',
    'snapshot': 'snapshotting the weights before this update; training goes on',
    'stop': 'training stops before this update, as on a stop signal'}
#: ... where the last update already made learned params non-finite
NAN_EFFECTS_ON_WEIGHTS = {
    'none': 'training goes on, as in Caffe',
    'snapshot': 'the last update made them so from finite gradients (is the learning rate '
                'too high?), so no snapshot can hold the weights before it; training goes on',
    'stop': 'the last update made them so from finite gradients (is the learning rate too '
            'high?); training stops, without a snapshot of them'}


class FirstNonFinite:
    """The first value of a run that is not finite, found once; and every update of running
    statistics that a SyncBN skipped, logged as it happens and counted."""

    def __init__(self):
        self.seen = False
        #: whether learned params are not finite, under a nan_effect that keeps them out of
        #: snapshots
        self.spoiled_weights = False
        #: {layer name: updates of its running statistics it skipped} in this run
        self.skipped = {}

    def log_skipped(self):
        """The count of skipped updates at the end of a run, if any."""
        if self.skipped:
            log.warning('%d update(s) of running statistics skipped because the statistics of '
                        'the batch were not finite: %s', sum(self.skipped.values()),
                        ', '.join("'%s' %d" % item for item in self.skipped.items()))

    def keep_unlearned(self, net, nan_effect):
        """While ``nan_effect`` wants a snapshot at the first non-finite: copies of the params
        no update changes (running statistics, frozen layers), which forward may spoil."""
        if nan_effect == 'none' or self.seen:
            return []
        return [(blob, blob.data.copy()) for blob, lr in
                zip(net.learnable_params, net.params_lr) if lr == 0]

    def check(self, loss, solver, unlearned, sums=None, gradients=True):
        """What is not finite the first time in ``solver``'s iteration (a Finding, see
        non_finite, with ``sums`` and ``gradients``), or None; the params of ``unlearned``
        (keep_unlearned) are then put back as they were before the passes. The updates its
        strategy's passes skipped (skipped_statistics) are logged first, each time."""
        skipped = solver.strategy.skipped_statistics()
        for name, (count, updates) in skipped.items():
            log.warning('Iteration %d: %s', solver.iter, skipped_text(name, count, updates))
            self.skipped[name] = self.skipped.get(name, 0) + count
        if self.seen:
            return None
        found, nan_effect = non_finite(loss, solver.net, sums, gradients, skipped), \
            solver.nan_effect
        if found is None:
            return None
        self.seen = True
        self.spoiled_weights = found.in_weights and nan_effect != 'none'
        for blob, before in unlearned:
            blob.data[...] = before
        return found


def effect_text(found, nan_effect):
    """What ``nan_effect`` does at ``found``, as the warning says it."""
    return (NAN_EFFECTS_ON_WEIGHTS if found.in_weights else NAN_EFFECTS)[nan_effect]


def check_passes(first, scale, solver, loss, unlearned):
    """After an iteration's passes, from one read of the device: the first value that is
    not finite (``first.check``: a Finding the first time, else None), and whether the
    update is skipped for gradients that are not finite (``scale``, the run's LossScale:
    under float16 it takes the gradients from ``first`` until it reaches its floor)."""
    watches_gradients = not scale.dynamic or scale.at_floor
    with np.errstate(over='ignore', invalid='ignore'):     # sums of an overflow: expected
        sums = watched_sums(solver.net) if scale.dynamic or not first.seen else None
    skip = scale.skips(solver.iter, sums is None or bool(np.isfinite(sums[1])), loss)
    return first.check(loss, solver, unlearned, sums, watches_gradients), skip
