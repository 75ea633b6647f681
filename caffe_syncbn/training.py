"""Data-parallel training: ``get_solver(solver_prototxt, devices='cpu:4', sync_bn=True)``.

Rules (the README states them for users):
- ``batch_size`` in the prototxt is PER DEVICE, as in Caffe's multi-GPU mode: one input
  pipeline draws a global batch of R x batch_size per forward and splits it over the R
  replicas along axis 0 (unevenly when the source gives fewer samples).
- Each replica runs forward and backward on its slice. Loss layers divide by the GLOBAL
  normalizer (see LayerContext.loss_normalizer) and SyncBN layers use global statistics.
- The gradients of the learned params are summed over replicas and divided by R, so the
  result is the gradient of one device on the whole batch. The sums run in buckets that
  start while backward goes on (gradients.py). Every replica then applies the same
  update, and params stay bitwise equal.
"""
import functools
import logging
import os
import time

import numpy as np

from . import caffe_pb2
from .backend import activate_gpu, to_numpy
from .comm import SoloComm, ThreadComm
from .convert import norm_units, to_syncbn
from .errors import CaffeError
from .gradients import DEFAULT_BUCKET_BYTES, GradientBuckets
from .layer import TRAIN, LayerContext
from .net import Net
from .parallel import DevicePool, InputPipeline, describe_devices, parse_devices, split_batch
from .solvers import get_solver_class, load_solver_param, upgrade_solver_param

log = logging.getLogger('caffe_syncbn')


def make_comms(devices):
    """One communicator member per device: none to speak of for one device, threads on
    the CPU, NCCL across distinct GPUs, the same-GPU communicator when GPUs repeat (NCCL
    refuses two ranks on one GPU)."""
    kinds = {kind for kind, _ in devices}
    if len(devices) == 1:
        return SoloComm.create()
    if kinds == {'cpu'}:
        return ThreadComm.create(len(devices))
    if kinds != {'gpu'}:
        raise CaffeError('devices mix CPU and GPU: %s' % (devices,))
    ids = [index for _, index in devices]
    if len(set(ids)) == 1 and len(ids) > 1:
        from .comm.same_device import SameDeviceComm
        return SameDeviceComm.create(len(ids), ids[0])
    if len(set(ids)) != len(ids):
        raise CaffeError('devices %s repeat some GPUs but not all; use distinct GPUs or one GPU '
                         'repeated' % (devices,))
    from .comm.nccl import NcclComm
    return NcclComm.create_all(ids)


def _share_cores(devices):
    """Virtual CPU devices share the machine's cores: give each replica's BLAS calls its
    share, or R replicas x all cores of BLAS threads fight over the same cores."""
    if len(devices) < 2 or devices[0][0] != 'cpu':
        return None
    import os
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=max(1, (os.cpu_count() or 1) // len(devices)), user_api='blas')


def _backend(kind):
    if kind == 'gpu':
        import cupy
        return cupy
    return np


class DataParallelMixin:
    """Turns a Solver class into a data-parallel one (put it first in the bases)."""

    #: about how many bytes of gradients go into one allreduce (gradients.py)
    gradient_bucket_bytes = DEFAULT_BUCKET_BYTES

    def __init__(self, solver, devices='cpu:1', sync_bn=False, dtype=None, seed=None,
                 level=None, stages=(), weights=None):
        self.devices = parse_devices(devices)
        for line in describe_devices(self.devices):
            log.info('%s', line)
        self.sync_bn = sync_bn
        self._train_state = caffe_pb2.NetState(stage=stages)
        if level is not None:
            self._train_state.level = level
        self._weights = weights
        self.comms = make_comms(self.devices)
        self._blas_limit = _share_cores(self.devices)
        self.pool = DevicePool(self.devices, self.comms)
        self.pool.run(self._activate_device)
        self.replicas, self.pipeline = [], None
        self._parts = [None] * len(self.devices)
        self._buckets = [None] * len(self.devices)
        self._seed = seed
        self._user_train_param = None
        kind = self.devices[0][0]
        super().__init__(solver, dtype=dtype, xp=_backend(kind))
        self.workers = [self.solver_base(self.param, net=net, test_nets=[], dtype=self.dtype, xp=self.xp)
                        for net in self.replicas[1:]]
        for worker in self.workers:
            worker.is_root = False
        self.broadcast_params()

    # ---- building -------------------------------------------------------------------------
    def _activate_device(self, rank):
        kind, index = self.devices[rank]
        if kind == 'gpu':
            activate_gpu(index)

    def create_net(self, net_param, phase):
        if phase == TRAIN:                   # caffe train -level/-stage: the train net only
            net_param.state.MergeFrom(self._train_state)
        if self.sync_bn:
            if phase == TRAIN:
                self._user_train_param = net_param
                _log_sync_bn(net_param)
            net_param = to_syncbn(net_param)[0]
        start = time.perf_counter()
        if phase != TRAIN:                   # test nets run alone, on replica 0's device
            context = LayerContext(phase=phase, xp=self.xp, dtype=self.dtype)
            net = self._on_root(lambda: Net(net_param, phase, level=net_param.state.level,
                                            context=context))
            _log_built(net, 'test', 1, start)
            return net
        if self.replicas:
            raise CaffeError('a data-parallel solver has exactly one train net')
        seed = self._seed if self._seed is not None else (self.param.random_seed
                                                           if self.param.random_seed >= 0 else 1701)
        # One after another: the fillers share one seeded RNG, and replica 0 must draw the
        # same weights whatever the number of devices (the others get replica 0's anyway).
        self.replicas = [self.pool.run_on(rank, functools.partial(
            self._build_net, net_param, phase, seed, rank)) for rank in range(len(self.devices))]
        root = self.replicas[0]
        _log_built(root, 'train', len(self.replicas), start)
        self._input_layers = [(layer.name, root.top_names[layer.name])
                              for layer in root.layers if layer.type == 'Input']
        readers = [layer for layer in root.layers
                   if hasattr(layer, 'make_reader') and layer.type != 'Input']
        _log_batches(readers, self._input_layers, len(self.replicas), self.param.iter_size)
        if readers:
            self.pipeline = InputPipeline(readers, len(self.replicas))
        return self.replicas[0]

    def _load_weights(self, net):
        """The solver's ``weights``, or those given to get_solver instead (as ``caffe train
        -weights`` replaces them), each with the time it took: a VGG-sized file takes seconds."""
        if self._weights is None:
            paths = [p.strip() for entry in self.param.weights for p in entry.split(',')]
        else:
            paths = list(self._weights)
        for path in filter(None, paths):
            log.info('Finetuning from %s', path)
            start = time.perf_counter()
            self.file_terms.load_weights(net, path)
            log.info('Loaded %s in %.2f s', path, time.perf_counter() - start)

    def _on_root(self, fn):
        return self.pool.run_on(0, fn)

    def _build_net(self, net_param, phase, seed, rank):
        context = LayerContext(phase=phase, xp=self.xp, dtype=self.dtype, comm=self.comms[rank],
                               rng=np.random.RandomState((seed + 7919 * rank) & 0xFFFFFFFF),
                               feeder=functools.partial(self._layer_feed, rank))
        return Net(net_param, phase, level=net_param.state.level, context=context)

    def broadcast_params(self):
        """Make every replica's blobs (params and statistics) equal to replica 0's."""
        def send(rank):
            for layer in self.replicas[rank].layers:
                for blob in layer.blobs:
                    self.comms[rank].broadcast(blob.data, root=0, tag='params')
        self.pool.run(send)

    # ---- data ------------------------------------------------------------------------------
    def _layer_feed(self, rank, layer):
        parts = self._parts[rank]
        if parts is None or layer.name not in parts['layers']:
            raise CaffeError("data layer '%s' has no batch from the input pipeline" % layer.name)
        return parts['layers'][layer.name]

    def _next_parts(self):
        """Split the next global batch: Input blobs from set_data_source (a dict of global
        arrays, split evenly, or a list of per-replica dicts), data layers from the pipeline."""
        count = len(self.replicas)
        parts = [{'layers': {}} for _ in range(count)]
        source = self._data_sources.get('train')
        if source is not None:
            batch = source()
            if isinstance(batch, dict):
                names = list(batch)
                pieces = split_batch([np.asarray(batch[n]) for n in names], count)
                batch = [dict(zip(names, piece)) for piece in pieces]
            elif len(batch) != count:
                raise CaffeError('the data source gave %d per-replica batches for %d replicas'
                                 % (len(batch), count))
            for rank, inputs in enumerate(batch):
                for name, tops in self._input_layers:
                    missing = [t for t in tops if t not in inputs]
                    if missing:
                        raise CaffeError("the data source gave no array for blob(s) %s of Input "
                                         "layer '%s'" % (', '.join(missing), name))
                    parts[rank]['layers'][name] = [np.asarray(inputs[t]) for t in tops]
        if self.pipeline is not None:
            for rank, layers in enumerate(self.pipeline.next_split()):
                parts[rank]['layers'].update(layers)
        return parts

    # ---- one iteration -----------------------------------------------------------------------
    def forward_backward_all(self):
        iter_size = self.param.iter_size
        self.pool.run(lambda rank: self.replicas[rank].clear_param_diffs())
        total = 0.0
        for k in range(iter_size):
            self._parts = self._next_parts()
            last = k == iter_size - 1      # the gradients are final in the last pass only
            total += sum(self.pool.run(lambda rank: self._forward_backward(rank, last)))
        if len(self.replicas) > 1:
            self.pool.run(lambda rank: self._gradient_buckets(rank).finish())
        return total / (iter_size * len(self.replicas))

    def _gradient_buckets(self, rank):
        if self._buckets[rank] is None:
            self._buckets[rank] = GradientBuckets(self.replicas[rank], self.comms[rank],
                                                  self.gradient_bucket_bytes)
        return self._buckets[rank]

    def _forward_backward(self, rank, reduce_gradients):
        overlap = reduce_gradients and len(self.replicas) > 1
        return self.replicas[rank].forward_backward(
            after_layer=self._gradient_buckets(rank).layer_done if overlap else None)

    def forward_all(self):
        """The display pass after training: a forward of every replica on the next batch."""
        self._parts = self._next_parts()
        return sum(self.pool.run(lambda rank: self.replicas[rank].forward_prefilled())) \
            / len(self.replicas)

    def log_outputs(self, net, which, values=None):
        """The train net's outputs as the mean over replicas: for a loss, whose replicas divide
        by the global normalizer, that mean is the loss of the global batch."""
        if net is self.net and values is None and len(self.replicas) > 1:
            values = {name: np.mean([to_numpy(r.blobs[name].data) for r in self.replicas], axis=0)
                      for name in net.outputs}
        super().log_outputs(net, which, values)

    def apply_update(self):
        solvers = [self] + self.workers
        for worker in self.workers:
            worker.iter = self.iter
        rates = self.pool.run(lambda rank: self.solver_base.apply_update(solvers[rank]))
        return rates[0]

    # ---- state -----------------------------------------------------------------------------
    def restore(self, path):
        super().restore(path)
        for worker in self.workers:
            worker.iter = self.iter
            worker.lr_policy.current_step = self.lr_policy.current_step
            for mine, root in zip(worker.rule.history, self.rule.history):
                mine[...] = worker.xp.asarray(root) if worker.xp is not None else root
        self.broadcast_params()

    def snapshot(self):
        """Caffe's snapshot, with a line saying how long it took and how large it is."""
        start = time.perf_counter()
        paths = super().snapshot()
        size = sum(os.path.getsize(p) for p in paths or () if os.path.isfile(p))
        log.info('Snapshot of iteration %d written: %.3g MB in %.2f s', self.iter, size / 1e6,
                 time.perf_counter() - start)
        return paths

    def make_file_terms(self):
        """Under --sync-bn, files speak the user's prototxt (BatchNorm+Scale or BN)."""
        if self._user_train_param is None:
            return super().make_file_terms()
        from .convert.terms import UserTerms
        return UserTerms(self._user_train_param, self.net)

    def copy_weights(self, path):
        """Finetune: load a caffemodel into every replica (by layer name). Under --sync-bn
        it may hold BatchNorm+Scale, BN or SyncBN layers."""
        self.file_terms.load_weights(self.net, path)
        self.broadcast_params()

    def close(self):
        if self.pipeline is not None:
            self.pipeline.close()
        self.pool.close()
        for comm in self.comms:
            comm.close()
        if self._blas_limit is not None:
            self._blas_limit.restore_original_limits()
            self._blas_limit = None


def _log_built(net, which, copies, start):
    params = sum(blob.count for layer in net.layers for blob in layer.blobs)
    log.info("Network initialization done: %s net '%s', %d layers, %d parameters%s, in %.2f s",
             which, net.name, len(net.layers), params,
             ' (x %d replicas)' % copies if copies > 1 else '', time.perf_counter() - start)


def _log_batches(readers, input_layers, replicas, iter_size):
    """The batch per device and per iteration: batch_size is per device, as in Caffe."""
    for layer in readers:
        total = layer.batch_size * replicas
        update = (' (x iter_size %d = %d per update)' % (iter_size, total * iter_size)
                  if iter_size > 1 else '')
        log.info("Batch of data layer '%s': %d per device x %d device(s) = %d per forward%s",
                 layer.name, layer.batch_size, replicas, total, update)
    for name, _ in input_layers:
        log.info("Batch of Input layer '%s': what the data source gives, split over %d "
                 'device(s)', name, replicas)


def _log_sync_bn(net_param):
    """Say what --sync-bn turns into SyncBN, and which of those keep frozen statistics."""
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
    frozen = [u.name for u in units if _is_frozen(net_param.layer[u.index])]
    if frozen:
        log.info('--sync-bn: %d of them keep their running statistics (use_global_stats: true '
                 'or frozen: true), as frozen SyncBN: %s', len(frozen), ', '.join(frozen))


def _is_frozen(layer):
    if layer.type == 'BatchNorm':
        p = layer.batch_norm_param
        return p.HasField('use_global_stats') and p.use_global_stats
    return layer.bn_param.frozen


@functools.lru_cache(maxsize=None)
def data_parallel_class(base):
    return type('DataParallel' + base.__name__, (DataParallelMixin, base),
                {'__module__': __name__, '__doc__': base.__doc__, 'solver_base': base})


def get_solver(solver, devices='cpu:1', sync_bn=False, dtype=None, level=None, stages=(),
               weights=None):
    """The solver a solver prototxt (or SolverParameter) asks for, running on ``devices``:
    'cpu:4' (virtual CPU devices), 'gpu:0,1', 'gpu:all', or 'gpu:0,0' (replicas sharing a GPU).
    ``sync_bn`` turns every BatchNorm(+Scale) and BN of the nets into SyncBN. ``level`` and
    ``stages`` add to the train net's NetState, and ``weights`` (caffemodel paths) replace
    the solver's own ``weights``, as caffe train's -level, -stage and -weights do."""
    if isinstance(solver, caffe_pb2.SolverParameter):
        solver_type = upgrade_solver_param(caffe_pb2.SolverParameter.FromString(
            solver.SerializeToString())).type
    else:
        solver_type = load_solver_param(solver).type
    cls = data_parallel_class(get_solver_class(solver_type))
    return cls(solver, devices=devices, sync_bn=sync_bn, dtype=dtype, level=level, stages=stages,
               weights=weights)
