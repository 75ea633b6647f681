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
no use_global_stats (its phase decides), so it makes none.

The loss normalizer: a loss layer of a replica divides by the global count over the
number of replicas (``loss_normalizer``), so that the solver's average of the replicas'
gradients is the gradient of one device on the whole batch. SyncBN's param diffs are
sums over the local batch, as every layer's, and come out right through it.

Asynchronous training refuses SyncBN, by -sync_bn or in the prototxt: SyncBN normalizes
with the statistics of all replicas in the same step, and asynchronous replicas take no
steps together.
"""
import logging

import numpy as np

from . import caffe_pb2
from .backend import get_array_module
from .errors import CaffeError

#: the layer types -sync_bn turns into SyncBN (a BatchNorm with its Scale, if it has one)
CONVERTED = ('BatchNorm', 'BN')
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


def check_asynchronous(sync_bn=False, layers=()):
    """Refuse asynchronous training with -sync_bn, or of a net with SyncBN ``layers``
    (anything with a type and a name), in one line that says why."""
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


def start_lines(net_param, units):
    """What the start log says of -sync_bn on ``net_param``, whose norm units are ``units``
    (weights/norm_forms.norm_units): what runs as SyncBN, how their running statistics
    accumulate, and which keep frozen statistics, as (logging level, line) pairs."""
    if not units:
        return [(logging.WARNING, "--sync-bn: net '%s' has no BatchNorm or BN layer; nothing "
                                  'is synchronized' % net_param.name)]
    forms = [('BatchNorm+Scale', sum(u.kind == 'BatchNorm' and u.scale_name is not None
                                      for u in units)),
             ('BatchNorm', sum(u.kind == 'BatchNorm' and u.scale_name is None for u in units)),
             (NVCAFFE_BATCHNORM, sum(u.kind == NVCAFFE_BATCHNORM for u in units)),
             ('BN', sum(u.kind == 'BN' for u in units)),
             ('SyncBN', sum(u.kind == 'SyncBN' for u in units))]
    lines = [(logging.INFO, '--sync-bn: %d layer(s) run as SyncBN (%s)' % (
        len(units), ', '.join('%d %s' % (n, form) for form, n in forms if n)))]
    sums = sum(u.keeps_sums for u in units)
    nvcaffe = sum(syncbn_statistics(net_param.layer[u.index]) == caffe_pb2.BNParameter.NVCAFFE
                  for u in units)
    momentum = len(units) - sums - nvcaffe
    conventions = [("%d as BatchNorm's sums (moving_average_fraction)" % sums, sums),
                   ('%d as a momentum average' % momentum, momentum),
                   ("%d as NVCaffe's average (its first update copies)" % nvcaffe, nvcaffe)]
    lines.append((logging.INFO, '--sync-bn: running statistics of the global batch, kept %s'
                  % ' and '.join(text for text, n in conventions if n)))
    frozen = [u.name for u in units if is_frozen(net_param.layer[u.index])]
    if frozen:
        lines.append((logging.INFO, '--sync-bn: %d of them keep their running statistics '
                                    '(use_global_stats: true or frozen: true), as frozen '
                                    'SyncBN: %s' % (len(frozen), ', '.join(frozen))))
    return lines
