"""The lines a data-parallel solver logs as it starts: each net's size and build time, the
batch per device and per iteration, and what --sync-bn turns into SyncBN and how those keep
their running statistics."""
import logging
import time

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


def log_sync_bn(net_param):
    """Say what --sync-bn turns into SyncBN, how their running statistics accumulate, and
    which of them keep frozen statistics."""
    units = norm_units(net_param.layer)
    if not units:
        log.warning("--sync-bn: net '%s' has no BatchNorm or BN layer; nothing is synchronized",
                    net_param.name)
        return
    forms = [('BatchNorm+Scale', sum(u.kind == 'BatchNorm' and u.scale_name is not None
                                      for u in units)),
             ('BatchNorm', sum(u.kind == 'BatchNorm' and u.scale_name is None for u in units)),
             ('BN', sum(u.kind == 'BN' for u in units)),
             ('SyncBN', sum(u.kind == 'SyncBN' for u in units))]
    log.info('--sync-bn: %d layer(s) run as SyncBN (%s)', len(units),
             ', '.join('%d %s' % (n, form) for form, n in forms if n))
    sums = sum(u.keeps_sums for u in units)
    conventions = [("%d as BatchNorm's sums (moving_average_fraction)" % sums, sums),
                   ('%d as a momentum average' % (len(units) - sums), len(units) - sums)]
    log.info('--sync-bn: running statistics of the global batch, kept %s',
             ' and '.join(text for text, n in conventions if n))
    frozen = [u.name for u in units if _is_frozen(net_param.layer[u.index])]
    if frozen:
        log.info('--sync-bn: %d of them keep their running statistics (use_global_stats: true '
                 'or frozen: true), as frozen SyncBN: %s', len(frozen), ', '.join(frozen))


def _is_frozen(layer):
    if layer.type == 'BatchNorm':
        p = layer.batch_norm_param
        return p.HasField('use_global_stats') and p.use_global_stats
    return layer.bn_param.frozen
