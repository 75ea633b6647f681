"""SyncBN's policy, in one place: what -sync_bn turns into SyncBN and which running
statistics each keeps, the loss normalizer of the global batch, what asynchronous
training refuses, and what the start log says of it. The mechanisms ask here: the SyncBN
layer and its two allreduces (layers/norm.py), the loss layers, to_syncbn (convert/
norm.py), which a data-parallel solver applies to each of its nets under -sync_bn
(training/data_parallel.py), the forms of batch norm weights (weights/norm_forms.py) and
the start log (training/start_log.py). docs/syncbn.md says it for users.

What converts: every batch normalization of a net (weights/norm_forms.norm_units):
BVLC's BatchNorm, with the Scale after it that only applies a per-channel affine,
NVCaffe's BatchNorm, which holds its own scale and bias (``nvcaffe_form``), and the forks'
BN. A SyncBN stays as it is, and so does every other layer.

Which statistics: a SyncBN keeps the convention of the layer it was written as, since
that is what the layer's files and users expect. One made of a BatchNorm keeps BVLC's
sums (``statistics: BATCHNORM``): its blobs, snapshots and TEST scores are those of
BatchNorm on one device with the global batch. One made of a BN keeps the forks'
momentum average (MOMENTUM). One made of NVCaffe's BatchNorm keeps NVCaffe's average,
whose first update copies the batch's statistics (NVCAFFE), with its engine's variance
and its least eps. All take the global batch's mean and variance, by the rules of
layers/norm/array.py (RunningSums, RunningAverage, FirstCopyAverage). A frozen layer
(use_global_stats: true, frozen: true) makes a frozen SyncBN; NVCaffe's BatchNorm reads
no use_global_stats (its phase decides), so it makes none. SegNet's and ENet's BN,
which shares its type name with PSPNet's and is told apart by its settings
(``is_segnet_bn``), keeps none: in LEARN mode it normalizes with the statistics of the
batch in every phase, the global batch's under -sync_bn, and its users fold the
statistics of their data set into its scale and shift after training (INFERENCE mode,
a per-channel affine that has nothing to synchronize).

The loss normalizer: a loss layer of a replica divides by the global count over the
number of replicas (``loss_normalizer``), so that the solver's average of the replicas'
gradients is the gradient of one device on the whole batch. SyncBN's param diffs are
sums over the local batch, as every layer's, and come out right through it.

Groups: under -sync_bn_group_size K, SyncBN layers share batch statistics within groups
of K consecutive replicas (comm/groups.py: which replicas form each, and where they run);
the loss normalizer and the gradients still span every replica. ``group_lines`` says in
the start log which replicas form each group and what each iteration exchanges.

Asynchronous training refuses SyncBN, by -sync_bn or in the prototxt: SyncBN normalizes
with the statistics of all replicas in the same step, and asynchronous replicas take no
steps together.
"""
import logging

import numpy as np

from . import caffe_pb2
from .backend import get_array_module
from .errors import CaffeError, layer_error

#: the layer types -sync_bn turns into SyncBN (a BatchNorm with its Scale, if it has one)
CONVERTED = ('BatchNorm', 'BN')
#: the settings of SegNet's and ENet's BN, and those of PSPNet's and yjxiong's (with ours)
SEGNET_BN_FIELDS = ('scale_filler', 'shift_filler', 'bn_mode')
PSPNET_BN_FIELDS = ('slope_filler', 'bias_filler', 'momentum', 'eps', 'frozen', 'engine',
                    'statistics')


def is_segnet_bn(layer):
    """Whether the BN or SyncBN LayerParameter ``layer`` is SegNet's and ENet's (blobs
    scale and shift, no running statistics) rather than PSPNet's and yjxiong's: it names
    SegNet's settings, or has the batch mean and variance tops only SegNet's has. A layer
    that names settings of both is refused."""
    if layer.type not in ('BN', 'SyncBN'):
        return False
    p = layer.bn_param
    segnet = [name for name in SEGNET_BN_FIELDS if p.HasField(name)]
    pspnet = [name for name in PSPNET_BN_FIELDS if p.HasField(name)]
    if segnet and pspnet:
        raise layer_error(layer, "bn_param mixes settings of SegNet's and ENet's BN (%s) with "
                                 "settings of PSPNet's BN (%s); the two forks' layers differ: "
                                 'keep the settings of one'
                                 % (', '.join(segnet), ', '.join(pspnet)))
    return bool(segnet) or len(layer.top) > 1
#: the kind of norm unit (weights/norm_forms.norm_units) of NVCaffe's BatchNorm
NVCAFFE_BATCHNORM = "NVCaffe's BatchNorm"
#: the least eps NVCaffe's BatchNorm takes, a float as it clamps it
NVCAFFE_MIN_EPS = float(np.float32(1e-5))


def nvcaffe_form(layer):
    """Whether the LayerParameter ``layer`` is NVCaffe's BatchNorm with its own scale and
    bias: scale_bias, or a scale or bias filler, as NVCaffe decides it."""
    if layer.type != 'BatchNorm':
        return False
    p = layer.batch_norm_param
    return p.scale_bias or p.HasField('scale_filler') or p.HasField('bias_filler')


def norm_eps(layer):
    """The eps the batch norm LayerParameter ``layer`` normalizes with."""
    if layer.type != 'BatchNorm':
        return layer.bn_param.eps
    eps = layer.batch_norm_param.eps
    return max(eps, NVCAFFE_MIN_EPS) if nvcaffe_form(layer) else eps


def syncbn_statistics(layer):
    """The convention (BNParameter.Statistics) of the SyncBN made of the batch norm
    LayerParameter ``layer``: a BatchNorm's sums, NVCaffe's average, or what a BN or SyncBN
    says (MOMENTUM unless it says otherwise)."""
    if nvcaffe_form(layer):
        return caffe_pb2.BNParameter.NVCAFFE
    if layer.type == 'BatchNorm':
        return caffe_pb2.BNParameter.BATCHNORM
    return layer.bn_param.statistics


def keeps_sums(layer):
    """Whether the batch norm LayerParameter ``layer`` keeps BVLC BatchNorm's sums, not a
    momentum average: a BatchNorm, and a SyncBN of BATCHNORM statistics (the forks' BN
    always averages)."""
    return layer.type in ('BatchNorm', 'SyncBN') and \
        syncbn_statistics(layer) == caffe_pb2.BNParameter.BATCHNORM


def is_frozen(layer):
    """Whether the batch norm LayerParameter ``layer`` keeps its running statistics
    (BatchNorm's use_global_stats: true, BN's or SyncBN's frozen: true; NVCaffe's BatchNorm
    never does)."""
    if nvcaffe_form(layer):
        return False
    if layer.type == 'BatchNorm':
        p = layer.batch_norm_param
        return p.HasField('use_global_stats') and p.use_global_stats
    return layer.bn_param.frozen


def loss_normalizer(comm, local_count):
    """Caffe's loss normalizer ``max(1, count)``, taken over the GLOBAL batch of the
    replicas that ``comm`` joins (None: one net alone, and this is Caffe's own).

    The solver averages replica gradients (divides their sum by the replica count R), so
    a replica that divides its local loss sum by ``max(1, global_count) / R`` makes the
    average equal the loss of one device on the whole batch, even when the replicas hold
    uneven splits or different numbers of ignored labels.

    ``local_count`` is a number, or a 0-d array counted on a device: that count stays
    there (a float64 0-d array comes back, summed over the replicas by a collective on
    the device), where a host number would make the host wait for the device.
    """
    size = comm.size if comm is not None else 1
    xp = get_array_module(local_count)
    if xp is np:
        if size == 1:
            return max(1.0, float(local_count))
        total = comm.allreduce_scalar(float(local_count), tag='loss normalizer')
        return max(1.0, total) / size
    count = local_count.astype(np.float64).reshape(1)
    if size > 1:
        comm.allreduce(count, tag='loss normalizer')
    return xp.maximum(count[0], 1.0) / size


def check_asynchronous(sync_bn=False, layers=(), group_size=None):
    """Refuse asynchronous training with -sync_bn or -sync_bn_group_size, or of a net with
    SyncBN ``layers`` (anything with a type and a name), in one line that says why."""
    if group_size is not None:
        raise CaffeError('-async cannot run with -sync_bn_group_size: groups share SyncBN '
                         'statistics in the same step, and asynchronous replicas take no '
                         'steps together')
    if sync_bn:
        raise CaffeError('-async cannot run with -sync_bn: SyncBN normalizes with the '
                         'statistics of all replicas in the same step, and asynchronous '
                         'replicas take no steps together')
    names = [layer.name for layer in layers if layer.type == 'SyncBN']
    if names:
        raise CaffeError('-async cannot train SyncBN layers (%s): they normalize with the '
                         'statistics of all replicas in the same step, and asynchronous '
                         'replicas take no steps together; use BatchNorm or BN'
                         % ', '.join(names))


def start_lines(net_param, units, grouped=False):
    """What the start log says of -sync_bn on ``net_param``, whose norm units are ``units``
    (weights/norm_forms.norm_units): what runs as SyncBN, how their running statistics
    accumulate (``grouped``: of each group's batch, -sync_bn_group_size), and which keep
    frozen statistics, as (logging level, line) pairs."""
    if not units:
        return [(logging.WARNING, "--sync-bn: net '%s' has no BatchNorm or BN layer; nothing "
                                  'is synchronized' % net_param.name)]
    forms = [('BatchNorm+Scale', sum(u.kind == 'BatchNorm' and u.scale_name is not None
                                      for u in units)),
             ('BatchNorm', sum(u.kind == 'BatchNorm' and u.scale_name is None for u in units)),
             (NVCAFFE_BATCHNORM, sum(u.kind == NVCAFFE_BATCHNORM for u in units)),
             ('BN', sum(u.kind == 'BN' for u in units)),
             ("SegNet's BN", sum(u.kind == 'SegNetBN' for u in units)),
             ('SyncBN', sum(u.kind == 'SyncBN' for u in units))]
    lines = [(logging.INFO, '--sync-bn: %d layer(s) run as SyncBN (%s)' % (
        len(units), ', '.join('%d %s' % (n, form) for form, n in forms if n)))]
    sums = sum(u.keeps_sums for u in units)
    segnet = sum(u.kind == 'SegNetBN' for u in units)
    nvcaffe = sum(syncbn_statistics(net_param.layer[u.index]) == caffe_pb2.BNParameter.NVCAFFE
                  for u in units)
    momentum = len(units) - sums - nvcaffe - segnet
    conventions = [("%d as BatchNorm's sums (moving_average_fraction)" % sums, sums),
                   ('%d as a momentum average' % momentum, momentum),
                   ("%d as NVCaffe's average (its first update copies)" % nvcaffe, nvcaffe)]
    if sums or momentum or nvcaffe:
        lines.append((logging.INFO, '--sync-bn: running statistics of the %s, kept %s'
                      % ("batch of each replica's group" if grouped else 'global batch',
                         ' and '.join(text for text, n in conventions if n))))
    if segnet:
        lines.append((logging.INFO, "--sync-bn: %d of them (SegNet's BN) keep no running "
                                    "statistics: bn_mode LEARN normalizes with the %s's "
                                    "statistics in every phase, INFERENCE applies scale and shift"
                      % (segnet, "group" if grouped else "global batch")))
    frozen = [u.name for u in units if is_frozen(net_param.layer[u.index])]
    if frozen:
        lines.append((logging.INFO, '--sync-bn: %d of them keep their running statistics '
                                    '(use_global_stats: true or frozen: true), as frozen '
                                    'SyncBN: %s' % (len(frozen), ', '.join(frozen))))
    return lines


def group_lines(shared, group_size, total, placement, crossing=()):
    """What the start log says of the groups SyncBN layers share statistics in, as (logging
    level, line) pairs: ``shared`` holds (channels, whether its backward runs) of each
    SyncBN layer that takes batch statistics, ``placement`` a line per group (Groups.
    describe; none when the replicas form one group) and ``crossing`` the groups that span
    nodes. Per layer and iteration a replica sends 1 + 2C float64 forward and 2C backward
    to the others of its group (as many back)."""
    if not shared and placement:
        return [(logging.WARNING, 'sync_bn_group_size %d: the train net has no SyncBN layer '
                                  'that takes batch statistics (-sync_bn makes them); nothing '
                                  'is grouped' % group_size)]
    if not shared or total == 1:
        return []
    buffers = sum(1 + backward for _, backward in shared)
    sent = 8 * sum(1 + 2 * channels + (2 * channels if backward else 0)
                   for channels, backward in shared)
    if group_size == 1:
        lines = [(logging.INFO, 'SyncBN: sync_bn_group_size 1: each of the %d replicas keeps '
                                'the statistics of its own batch (per-device batch norm); '
                                'nothing is exchanged for the %d SyncBN layer(s)'
                  % (total, len(shared)))]
    else:
        others = '%d other replica%s' % (group_size - 1, 's' if group_size > 2 else '')
        lines = [(logging.INFO, 'SyncBN: %d layer(s) share batch statistics over %s; per '
                                'iteration each replica reduces %d buffers, %s, with %s'
                  % (len(shared), 'groups of %d replicas' % group_size if placement else
                     'all %d replicas' % total, buffers,
                     '%d bytes' % sent if sent < 10000 else '%.1f KB' % (sent / 1e3),
                     'the %s of its group' % others if placement else 'the %s' % others))]
    lines += [(logging.INFO, 'SyncBN %s' % line) for line in placement if group_size > 1]
    if crossing:
        lines.append((logging.WARNING, 'SyncBN: group(s) %s span several nodes, so their '
                                       'statistics cross the network; a sync_bn_group_size '
                                       'that divides the replicas of each node keeps every '
                                       'group within one' % ', '.join(map(str, crossing))))
    return lines
