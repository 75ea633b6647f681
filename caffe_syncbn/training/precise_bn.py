"""Exact PreciseBN: every batch norm's running statistics re-estimated as the population
mean and variance of its input over K global batches, with the sums of every replica.

Running statistics that training leaves are averages of batches seen while the weights
still moved, and per-device BN's are one device's. PreciseBN replaces them with the
statistics of what TEST will feed each layer: the input of batch norm l, over the same K
global batches, computed with every batch norm before l already normalizing with its new
statistics (later layers' inputs depend on earlier layers' statistics; estimating all at
once from batch-normalized passes gives each layer the statistics of inputs TEST never
produces).

The order: the layers to estimate go in net order, which is an order of their inputs'
dependencies, in passes over the K batches. A pass takes the next layers in net order as
long as none reads the output of another of the same pass (ResNet's shortcut and first
branch batch norms share one pass), so a chain of L batch norms takes L passes; a pass
runs the net up to its last layer only. The passes read the same K batches: the input
pipeline starts again from the same seed, and each replica's random layers (Dropout) draw
from a seed of (batch, global replica).

Every batch norm runs on its running statistics from the start (``use_running_statistics``),
so nothing updates or communicates in the forwards. Each replica adds up, per layer and
channel, the count and the sums of (x - K) and (x - K)^2 over its parts of the K batches
(float64; K: the layer's old running mean, as SyncBN shifts), and a pass ends with ONE
allreduce of all its layers' sums. Every replica then writes the same numbers: the
statistics are bitwise identical on every replica of every process.

What is written, in the layer's own convention (layers/norm/array.py, ``population``):
the statistics one TRAIN update of the layer would take from a single batch made of all
M values (M: the layer's values per channel over the K global batches): their mean, and
the variance as that layer's update estimates a batch's, unbiased, M/(M-1) times the
biased one, for BatchNorm and SyncBN (Caffe's BatchNorm keeps m/(m-1)·var of each batch),
biased for the forks' BN, whose running variance averages biased batch variances. So TEST
and every tool that reads the file (fold-bn, export) take the result as they take trained
statistics. BatchNorm's sums are written with the factor s its training tends to, a power
of two: TEST's mean_sum/s and var_sum/s are the statistics exactly.

Batch norms with frozen statistics (use_global_stats: true, frozen: true) keep them.
"""
import functools
import logging
import os
import time

import numpy as np

from ..backend import cpu_threads, get_array_module, to_numpy
from ..comm.mpi import job_link
from ..errors import CaffeError
from ..layer import TRAIN
from ..layers.norm.array import STAT, channel_view, moments
from ..netparam.upgrade import load_net_param
from ..precision import run_dtypes
from ..syncbn_policy import is_frozen, is_segnet_bn
from .device_names import describe_devices, parse_devices
from .replicas import Replicas
from .start_log import log_batches, log_built

log = logging.getLogger('caffe_syncbn')

#: the layer types whose running statistics PreciseBN estimates
NORM_TYPES = ('BatchNorm', 'BN', 'SyncBN')
#: the input pipeline's seed (the same K batches in every pass and every process)
SEED = 1701


def passes(net, targets):
    """The layers ``targets`` (indices into net.layers, in net order) grouped into passes:
    each pass the next layers in net order while none depends on another of the pass
    through the blobs between them."""
    upstream, above_blob = {}, {}
    for i, layer in enumerate(net.layers):
        above = frozenset().union(*(above_blob.get(name, frozenset())
                                    for name in net.bottom_names[layer.name]))
        if i in targets:
            upstream[i] = above
            above = above | {i}
        for name in net.top_names[layer.name]:
            above_blob[name] = above
    groups = [[]]
    for i in sorted(targets):
        if upstream[i] & set(groups[-1]):
            groups.append([])
        groups[-1].append(i)
    return groups


class PreciseBN:
    """The replicas of a PreciseBN run over ``devices`` (as get_solver takes them): the
    net of ``model`` in ``phase`` (its data layers read the batches) with ``weights``
    loaded. ``estimate(K)`` re-estimates the statistics, ``save(path)`` writes the
    weights (process 0, under an MPI launcher), ``close()`` ends the threads."""

    def __init__(self, model, weights, devices='cpu:1', phase=TRAIN, level=0, stages=(),
                 dtype=np.float32, link='auto', seed=SEED):
        self.seed, self.weights = seed, list(weights)
        start = time.perf_counter()
        devices = parse_devices(devices)
        net_param = load_net_param(model)
        net_param.state.level = level
        net_param.state.stage.extend(stages)
        self.replication = replicas = Replicas(devices, job_link() if link == 'auto' else link)
        self._blas_limit = None
        try:
            for line in describe_devices(devices, replicas):
                log.info('%s', line)
            if devices[0].kind == 'cpu':
                self._blas_limit = cpu_threads.share_blas(len(devices) * (
                    replicas.link.processes_on_this_node() if replicas.link else 1))
            replicas.pool.run(lambda rank: devices[rank].activate())
            self.net = replicas.build(net_param, phase, seed, devices[0].xp,
                                      run_dtypes('float32', dtype), 'off')
            cpu_threads.start([functools.partial(replicas.pool.submit, rank)
                               for rank in range(len(devices))]
                              if devices[0].kind == 'cpu' else ())
            log_built(self.net, 'PreciseBN', replicas.total, start)
            self.targets = self._targets(model)
            self.passes = passes(self.net, set(self.targets))
            for path in self.weights:
                log.info('Loading %s', path)
                replicas.pool.run_on(0, functools.partial(self.net.copy_from, path))
            replicas.pool.run(self._broadcast_blobs)
            replicas.pool.run(self._use_running_statistics)
        except BaseException:
            self.close()
            raise
        log_batches(replicas.data_layers(), [], replicas, 1)

    def _targets(self, model):
        """The indices of the batch norms to estimate, once the net is known to have data
        layers and no Input blobs; one error where there is nothing to do."""
        net = self.net
        if not self.replication.data_layers():
            raise CaffeError("%s: net '%s' has no data layer (Data, ImageData, HDF5Data, ...) in "
                             'this phase: PreciseBN estimates the statistics over the batches '
                             "of the net's own data layers" % (model, net.name))
        if net.inputs:
            raise CaffeError("%s: net '%s' has Input blobs (%s), and PreciseBN has nothing to "
                             'fill them with; give the net a data layer'
                             % (model, net.name, ', '.join(map(repr, net.inputs))))
        frozen = [layer.name for layer in net.layers
                  if layer.type in NORM_TYPES and is_frozen(layer.param)]
        segnet = [layer.name for layer in net.layers if is_segnet_bn(layer.param)]
        targets = [i for i, layer in enumerate(net.layers)
                   if layer.type in NORM_TYPES and layer.name not in frozen + segnet]
        if not targets:
            why = ['%d frozen' % len(frozen)] * bool(frozen) + \
                ["%d SegNet's BN, which keep no running statistics" % len(segnet)] * bool(segnet)
            raise CaffeError("%s: net '%s' has no batch norm (BatchNorm, BN, SyncBN) whose "
                             'statistics PreciseBN could estimate%s' % (
                                 model, net.name, ' (%s)' % ', '.join(why) if why else ''))
        if frozen:
            log.info('PreciseBN: %d batch norm(s) keep their frozen statistics '
                     '(use_global_stats: true or frozen: true): %s', len(frozen), ', '.join(frozen))
        if segnet:
            log.info("PreciseBN: %d of SegNet's BN keep no running statistics (bn_mode LEARN "
                     'normalizes with each batch, INFERENCE is an affine): %s',
                     len(segnet), ', '.join(segnet))
        return targets

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def nets(self):
        """The local replica nets."""
        return self.replication.nets

    def _broadcast_blobs(self, rank):
        """Every replica's blobs those of global replica 0, which loaded the weights."""
        comm = self.replication.comms[rank]
        for layer in self.nets[rank].layers:
            for blob in layer.blobs:
                comm.broadcast(blob.data, root=0, tag='weights')

    def _use_running_statistics(self, rank):
        for layer in self.nets[rank].layers:
            if layer.type in NORM_TYPES and not is_segnet_bn(layer.param):
                layer.use_running_statistics()

    # ---- estimating ----------------------------------------------------------------------
    def estimate(self, iterations, progress=None):
        """Re-estimate every batch norm over ``iterations`` global batches (module doc);
        ``progress(1)`` is called after each batch of each pass. Returns {layer name:
        (count, mean, biased variance)} as float64 numpy arrays."""
        if iterations < 1:
            raise CaffeError('PreciseBN needs at least 1 global batch, got %d' % iterations)
        log.info('PreciseBN: %d batch norm(s) in %d pass(es) over the same %d global batches, '
                 'each pass with the layers before it on their new statistics',
                 len(self.targets), len(self.passes), iterations)
        found = {}
        for number, group in enumerate(self.passes, 1):
            log.info('PreciseBN pass %d of %d: %s', number, len(self.passes),
                     ', '.join(self.net.layers[i].name for i in group))
            found.update(self._one_pass(group, iterations, progress))
        return found

    def _one_pass(self, group, iterations, progress):
        replicas = self.replication
        shifts = replicas.pool.run(functools.partial(self._shifts, group))
        before = replicas.pool.run_on(0, lambda: [tuple(to_numpy(v) for v in
                                                        self.net.layers[i].statistics.running())
                                                  for i in group])
        totals = [None] * len(replicas)
        if replicas.pipeline is not None:
            replicas.pipeline.close()
        replicas.start_pipeline(self.seed)
        for batch in range(iterations):
            replicas.next_parts()
            totals = replicas.pool.run(lambda rank: self._add_batch(
                rank, group, shifts[rank], batch, totals[rank]))
            if progress is not None:
                progress(1)
        reduced = replicas.pool.run(lambda rank: self._reduce(rank, totals[rank]))
        found = self._check(group, reduced[0][1], shifts[0], iterations)
        replicas.pool.run(lambda rank: self._store(rank, group, reduced[rank][0], shifts[rank]))
        for i, (old_mean, old_var) in zip(group, before):
            name = self.net.layers[i].name
            log_change(name, old_mean, old_var, *found[name])
        return found

    def _shifts(self, group, rank):
        """Each layer's old running mean, which every replica holds alike, in the blob
        dtype (which every engine holds exactly); 0 where it is not finite."""
        means = [layer.statistics.running()[0].astype(layer.dtype).astype(STAT)
                 for layer in (self.nets[rank].layers[i] for i in group)]
        return [get_array_module(mean).where(get_array_module(mean).isfinite(mean), mean, 0)
                for mean in means]

    def _add_batch(self, rank, group, shifts, batch, totals):
        """Run replica ``rank``'s part of one batch up to each layer of ``group`` in turn,
        adding its input's sums to ``totals`` (one packed array per layer)."""
        net, first = self.nets[rank], self.replication.first
        net.context.rng.seed([self.seed, first + rank, batch])
        done, sums = 0, []
        for i, shift in zip(group, shifts):
            if i > done:
                net.forward_prefilled(done, i - 1)
            done = i
            layer = net.layers[i]
            x3 = channel_view(net.blobs[net.bottom_names[layer.name][0]].data)
            sums.append(layer.engine.local_sums(x3, shift)[0])
        return sums if totals is None else [t + s for t, s in zip(totals, sums)]

    def _reduce(self, rank, totals):
        """ONE allreduce of the pass's sums; the reduced array and its host copy."""
        packed = get_array_module(totals[0]).concatenate(totals)
        self.replication.comms[rank].allreduce(packed, tag='PreciseBN')
        return packed, to_numpy(packed)

    def _check(self, group, packed, shifts, iterations):
        """{name: (count, mean, biased var)} of each layer, from the host copy of the sums;
        one error for a layer that saw no values, or whose input is not finite."""
        found, offset = {}, 0
        for i, shift in zip(group, shifts):
            name = self.net.layers[i].name
            size = 1 + 2 * shift.size
            if packed[offset] == 0:
                raise CaffeError("PreciseBN: the input of layer '%s' held no values in %d "
                                 'global batches' % (name, iterations))
            with np.errstate(invalid='ignore', over='ignore'):      # checked below
                count, mean, var = moments(packed[offset:offset + size], to_numpy(shift))
            offset += size
            bad = np.flatnonzero(~(np.isfinite(mean) & np.isfinite(var)))
            if bad.size:
                raise CaffeError("PreciseBN: the input of layer '%s' is not finite over %d "
                                 'global batches (channel %d of %d: mean %g, variance %g); the '
                                 'weights or the data make the net overflow before it'
                                 % (name, iterations, bad[0], mean.size, mean[bad[0]],
                                    var[bad[0]]))
            found[name] = (count, mean, var)
        return found

    def _store(self, rank, group, packed, shifts):
        offset = 0
        for i, shift in zip(group, shifts):
            size = 1 + 2 * shift.size
            layer = self.nets[rank].layers[i]
            layer.statistics.population(*moments(packed[offset:offset + size], shift))
            offset += size

    # ---- the result ----------------------------------------------------------------------
    def save(self, path):
        """Write the weights, statistics included, as Net.save does (Net.save_hdf5 for a
        path ending in .h5); process 0 of an MPI job writes, the others return."""
        if self.replication.process != 0:
            return
        save = self.net.save_hdf5 if os.fspath(path).endswith('.h5') else self.net.save
        self.replication.pool.run_on(0, functools.partial(save, path))
        log.info('PreciseBN: wrote %s', path)

    def close(self):
        self.replication.close()
        if self._blas_limit is not None:
            self._blas_limit.restore_original_limits()
            self._blas_limit = None


def log_change(name, old_mean, old_var, count, mean, var):
    """One line: how far the new statistics moved from the running ones."""
    std = np.sqrt(np.maximum(var, 0))
    with np.errstate(divide='ignore', invalid='ignore'):
        shift = np.abs(mean - old_mean) / std
        ratio = std / np.sqrt(np.maximum(old_var, 0))
    finite = ratio[np.isfinite(ratio)]
    log.info("PreciseBN '%s': %d channels, %d values each; the mean moved by up to %.3g "
             'std, the std by a factor %s', name, mean.size, int(count[0]),
             np.nanmax(shift) if np.isfinite(shift).any() else float('nan'),
             '%.3g to %.3g' % (finite.min(), finite.max()) if finite.size
             else 'beyond measure (the running variance was 0)')
