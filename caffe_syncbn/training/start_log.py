"""The lines a data-parallel solver logs as it starts: each net's size and build time, the
batch per device and per iteration, what --sync-bn turns into SyncBN and how those keep
their running statistics, and which replicas share SyncBN's statistics at what cost."""
import logging
import time

from ..syncbn_policy import group_lines, start_lines
from ..weights.norm_forms import norm_units

log = logging.getLogger('caffe_syncbn')


def log_built(net, which, copies, start):
    params = sum(blob.count for layer in net.layers for blob in layer.blobs)
    log.info("Network initialization done: %s net '%s', %d layers, %d parameters%s, in %.2f s",
             which, net.name, len(net.layers), params,
             ' (x %d replicas)' % copies if copies > 1 else '', time.perf_counter() - start)


def log_batches(readers, input_layers, replication, iter_size):
    """The batch per device and per iteration: batch_size is per device, as in Caffe."""
    replicas = replication.total
    where = ' in %d processes' % replication.processes if replication.processes > 1 else ''
    for layer in readers:
        total = layer.batch_size * replicas
        update = (' (x iter_size %d = %d per update)' % (iter_size, total * iter_size)
                  if iter_size > 1 else '')
        log.info("Batch of data layer '%s': %d per device x %d device(s)%s = %d per forward%s",
                 layer.name, layer.batch_size, replicas, where, total, update)
    for name, _ in input_layers:
        log.info("Batch of Input layer '%s': what the data source gives, split over %d "
                 'device(s)%s', name, replicas, where)


def log_sync_bn(net_param, grouped=False):
    """Say what --sync-bn turns into SyncBN, how their running statistics accumulate
    (``grouped``: of each SyncBN group's batch), and which of them keep frozen statistics
    (syncbn_policy.start_lines)."""
    for level, line in start_lines(net_param, norm_units(net_param.layer), grouped):
        log.log(level, line)


def log_groups(net, replication):
    """Which replicas share the statistics of ``net``'s SyncBN layers, and what that costs
    per iteration (syncbn_policy.group_lines)."""
    shared = [(layer.channels, layer.backward_runs) for layer in net.layers
              if layer.type == 'SyncBN' and layer.uses_batch_formula()]
    groups = replication.groups
    placement = groups.describe(replication.nodes) if groups is not None else []
    crossing = groups.crossing_nodes(replication.nodes) \
        if groups is not None and replication.nodes is not None else []
    for level, line in group_lines(shared, replication.group_size, replication.total,
                                   placement, crossing):
        log.log(level, line)
