"""Data-parallel training: ``get_solver(solver_prototxt, devices='cpu:4', sync_bn=True)``.

Rules (the README states them for users):
- ``batch_size`` in the prototxt is PER DEVICE, as in Caffe's multi-GPU mode: one input
  pipeline draws a global batch of R x batch_size per forward and splits it over the R
  replicas along axis 0 (unevenly when the source gives fewer samples).
- Each replica runs forward and backward on its slice. Loss layers divide by the GLOBAL
  normalizer and SyncBN layers use global statistics (syncbn_policy.py: SyncBN's policy,
  what -sync_bn converts, and what -async refuses).
- The gradients of the learned params are summed over replicas and divided by R, so the
  result is the gradient of one device on the whole batch. The sums run in buckets that
  start while backward goes on (gradient_buckets.py). Every replica then applies the same
  update, and params stay bitwise equal.

The solver holds its replicas as a component (replicas.py) and, as its strategy (the
seam of solver.py), the way they make updates: synchronous (synchronous.py) or
asynchronous (asynchronous.py). Under mpiexec or srun the replicas of every process form
one run (comm/mpi.py): process 0 logs, tests and snapshots; the others log only warnings
and errors. A solver holds threads: ``close()`` it, use it in a ``with``, or drop it (the
threads end when it is collected).
"""
import functools
import json
import logging
import os
import time
import weakref

import numpy as np

from .. import caffe_pb2
from ..backend import cpu_threads, to_numpy
from ..backend.one_caller import one_at_a_time
from ..comm.mpi import job_link
from ..convert import to_syncbn
from ..errors import CaffeError
from ..formats.atomic import atomic_write
from ..layer import TRAIN, LayerContext
from ..net import Net
from ..precision import check_precision
from ..syncbn_policy import check_asynchronous
from .asynchronous import Asynchronous
from .device_names import describe_devices, parse_devices
from .replicas import Replicas
from .snapshot_layout import UserLayout
from .solver import Solver
from .solver_checks import NAN_EFFECTS
from .start_log import log_batches, log_built, log_groups, log_sync_bn
from .synchronous import Synchronous

log = logging.getLogger('caffe_syncbn')
MODES = ('sync', 'async')
#: beside a solverstate: the number of replicas and the global batches of its run
RUN_FILE_SUFFIX = '.replicas.json'


def _share_cores(devices, link):
    """Virtual CPU devices share the machine's cores with the devices of the job's other
    processes on it, and so its BLAS threads."""
    processes = link.processes_on_this_node() if link is not None else 1
    return cpu_threads.share_blas(len(devices) * processes) if devices[0].kind == 'cpu' else None


class DataParallelSolver(Solver):
    """Caffe's solver of the type the solver file names, over replicas on ``devices``:
    ``mode`` 'sync' (one global batch per update) or 'async' (see asynchronous.py), in
    this process or, under an MPI launcher, in every process of the job (``link``)."""

    def __init__(self, solver, devices='cpu:1', sync_bn=False, dtype=None, seed=None,
                 level=None, stages=(), weights=None, mode='sync', max_staleness=None,
                 link='auto', memory_plan=None, sync_bn_group_size=None, precision='float32'):
        if mode not in MODES:
            raise CaffeError('mode %r: expected one of %s' % (mode, ', '.join(MODES)))
        if mode == 'async':
            check_asynchronous(sync_bn=sync_bn, group_size=sync_bn_group_size)
            if check_precision(precision) != 'float32':
                raise CaffeError('-precision %s needs synchronous updates: a loss scale, and '
                                 'the update it skips, hold for one global batch' % precision)
        if max_staleness is not None and (mode != 'async' or max_staleness < 0):
            raise CaffeError('-max_staleness %s: needs -async and a number >= 0' % max_staleness)
        devices = parse_devices(devices)
        link = job_link() if link == 'auto' else link
        self.replication = Replicas(devices, link, communicate=mode == 'sync',
                                    group_size=sync_bn_group_size)
        for line in describe_devices(devices, self.replication):
            log.info('%s', line)
        self.sync_bn = sync_bn
        self._train_state = caffe_pb2.NetState(stage=stages)
        if level is not None:
            self._train_state.level = level
        self._weights = weights
        strategy = Synchronous(self, self.replication) if mode == 'sync' else \
            Asynchronous(self, self.replication, max_staleness)
        # the threads end when the solver is collected: nothing here holds the solver
        self._release = weakref.finalize(self, _release, strategy, self.replication,
                                         _share_cores(devices, link))
        self.pool.run(lambda rank: self.devices[rank].activate())
        self._seed = seed
        self._user_train_param = None
        self._testing = False
        super().__init__(solver, dtype=dtype, xp=devices[0].xp, strategy=strategy,
                         memory_plan=memory_plan, precision=precision)
        self.strategy.start()

    # ---- what the component holds ------------------------------------------------------------
    @property
    def replicas(self):
        """The local replica nets."""
        return self.replication.nets

    @property
    def pool(self):
        return self.replication.pool

    @property
    def pipeline(self):
        return self.replication.pipeline

    @property
    def devices(self):
        return self.replication.devices

    @property
    def process(self):
        """This process's rank in an MPI job (0 alone)."""
        return self.replication.process

    # ---- building -------------------------------------------------------------------------
    def create_net(self, net_param, phase):
        if phase == TRAIN:                   # caffe train -level/-stage: the train net only
            net_param.state.MergeFrom(self._train_state)
        if self.sync_bn:
            if phase == TRAIN:
                self._user_train_param = net_param
                log_sync_bn(net_param, self.replication.groups is not None)
            net_param = to_syncbn(net_param)[0]
        start = time.perf_counter()
        if phase != TRAIN:                   # test nets run alone, on replica 0's device
            net = self._alone(net_param, phase)
            log_built(net, 'test', 1, start)
            return net
        if self.replicas:
            raise CaffeError('a data-parallel solver has exactly one train net')
        seed = self._seed if self._seed is not None else (self.param.random_seed
                                                           if self.param.random_seed >= 0 else 1701)
        replication = self.replication
        root = replication.build(net_param, phase, seed, self.xp, (
            self.dtype, self.activation_dtype), self.memory_plan)
        log_built(root, 'train', replication.total, start)
        log_groups(root, replication)
        readers = replication.data_layers()
        log_batches(readers, replication.input_layers, replication, self.param.iter_size)
        replication.start_pipeline(seed, per_replica=not self.strategy.lockstep)
        return self.strategy.train_net(lambda: self._alone(net_param, phase), root)

    def prepare_blas(self):
        """The BLAS's buffers for every replica's thread (cpu_threads.start)."""
        if self.devices[0].kind == 'cpu':
            cpu_threads.start([functools.partial(self.pool.submit, rank)
                               for rank in range(len(self.devices))])
        else:
            cpu_threads.start()

    def on_net_device(self, fn):
        """``fn()`` in replica 0's thread: its device current, its stream, and its queued
        work done when ``fn`` returns (DevicePool)."""
        return self.pool.run_on(0, fn)

    def _alone(self, net_param, phase):
        """A net of its own on replica 0's device (test nets, the asynchronous holder)."""
        context = LayerContext(phase=phase, xp=self.xp, dtype=self.dtype,
                               activation_dtype=self.activation_dtype)
        return self.pool.run_on(0, lambda: Net(net_param, phase, level=net_param.state.level,
                                               context=context, memory_plan=self.memory_plan))

    def load_weights(self, net):
        """The solver's ``weights``, or those given to get_solver instead (as ``caffe train
        -weights`` replaces them), each with the time it took: a VGG-sized file takes seconds."""
        if self._weights is None:
            paths = [p.strip() for entry in self.param.weights for p in entry.split(',')]
        else:
            paths = list(self._weights)
        for path in filter(None, paths):
            log.info('Finetuning from %s', path)
            start = time.perf_counter()
            self.snapshot_layout.load_weights(net, path)
            log.info('Loaded %s in %.2f s', path, time.perf_counter() - start)

    def broadcast_params(self):
        """Make every replica's blobs (params and statistics) equal to replica 0's."""
        self.strategy.broadcast_params()

    # ---- data ------------------------------------------------------------------------------
    def next_parts(self):
        """The local replicas' parts of the next global batch (Replicas.next_parts)."""
        self.replication.next_parts(self.data_sources.get('train'))

    def next_part(self, rank):
        """Asynchronous replicas: replica ``rank``'s next batch (Replicas.next_part)."""
        self.replication.next_part(rank, self.data_sources.get('train'))

    def add_callback(self, on_start, on_gradients_ready=None):
        """Refused: the replicas' passes run in their own threads, without these hooks."""
        raise CaffeError('add_callback works with the single-device solvers (caffe.SGDSolver, '
                         'caffe.get_solver), not with %s' % type(self).__name__)

    def log_outputs(self, net, which, values=None):
        """The train net's outputs as the mean over all replicas: for a loss, whose replicas
        divide by the global normalizer, that mean is the loss of the global batch."""
        if net is self.net and values is None and not self.strategy.lockstep:
            # the holder runs no forward: replica 0's outputs, of its last batch
            values = {name: to_numpy(self.replicas[0].blobs[name].data) for name in net.outputs}
        elif net is self.net and values is None and self.replication.total > 1:
            outputs = [{name: to_numpy(r.blobs[name].data) for name in net.outputs}
                       for r in self.replicas]
            values = {}
            for name in net.outputs:
                shape = np.shape(outputs[0][name])
                total = self.replication.sum_over_all([o[name] for o in outputs])
                values[name] = (total / self.replication.total).reshape(shape)
        super().log_outputs(net, which, values)

    # ---- processes -----------------------------------------------------------------------------
    @one_at_a_time('test_all')
    def test_all(self):
        """Process 0 tests; the others learn whether a stop came during the test."""
        if self.process == 0:
            self._testing = True
            try:
                results = super().test_all()
            finally:
                self._testing = False
        else:
            results = []
        if self.replication.processes > 1 and self.strategy.lockstep:
            self.requested_early_exit = bool(self._agree([0, self.requested_early_exit])[1])
        return results

    def requested_action(self):
        """A stop or snapshot request (a signal) of any process holds for all of them: they
        agree on it between iterations, so they stop at the same one (after a snapshot,
        where one process asked for it)."""
        action = super().requested_action()
        if self._testing or self.replication.processes == 1 or not self.strategy.lockstep:
            return action
        snapshot, stop = self._agree([action in ('snapshot', 'snapshot_stop'),
                                      action in ('stop', 'snapshot_stop')])
        return {(True, True): 'snapshot_stop', (True, False): 'snapshot',
                (False, True): 'stop'}.get((bool(snapshot), bool(stop)))

    def _non_finite_effect(self, loss, unlearned):
        """Under -nan_effect snapshot or stop, the processes agree on the first value that is
        not finite, as on a signal: a running statistic of one process's replica may be the
        only one."""
        if self.nan_effect == 'none' or self._non_finite.seen or \
                self.replication.processes == 1 or not self.strategy.lockstep:
            return super()._non_finite_effect(loss, unlearned)
        effect = super()._non_finite_effect(loss, unlearned)
        if effect is None and self._agree([False])[0]:
            self._non_finite.seen = True
            log.warning('Iteration %d: another process found a value that is not finite (its '
                        'warning names it); %s', self.iter, NAN_EFFECTS[self.nan_effect])
            return self.nan_effect
        if effect is not None:
            self._agree([True])
        return effect

    def _agree(self, flags):
        values = [np.array(flags, np.float64)] + \
            [np.zeros(len(flags)) for _ in range(len(self.replication) - 1)]
        return self.replication.sum_over_all(values) > 0

    # ---- state -----------------------------------------------------------------------------
    @one_at_a_time('restore')
    def restore(self, path):
        super().restore(path)
        self._warn_if_global_batch_changed(path)
        self.strategy.after_restore()

    def global_batches(self):
        """{data layer: its global batch} (batch_size is per device)."""
        return {layer.name: layer.batch_size * self.replication.total
                for layer in self.replication.data_layers()}

    def _warn_if_global_batch_changed(self, state_path):
        """The global batch of the run a snapshot came from is in a file beside it; a
        resume on another number of devices or processes changes it."""
        if self.process != 0:
            return
        try:
            with open(os.fspath(state_path) + RUN_FILE_SUFFIX) as f:
                before = json.load(f)
        except (OSError, ValueError):
            return
        batches = before.get('global_batches') if isinstance(before, dict) else None
        if not isinstance(batches, dict):       # not a file of ours: nothing to compare
            return
        now = self.global_batches()
        changed = {name: (batches[name], batch) for name, batch in now.items()
                   if batches.get(name, batch) != batch}
        for name, (old, new) in changed.items():
            log.warning("Resuming with %d replicas where the snapshot was written by %s: the "
                        "global batch of data layer '%s' changes from %d to %d (batch_size is per "
                        'device); adjust base_lr or batch_size if that is not what you want',
                        self.replication.total, before.get('replicas', '?'), name, old, new)

    @one_at_a_time('snapshot')
    def snapshot(self):
        """Caffe's snapshot, written by process 0 alone, with a line saying how long it took
        and how large it is."""
        if self.process != 0:
            return None
        start = time.perf_counter()
        paths = super().snapshot()
        if paths:
            with atomic_write(paths[1] + RUN_FILE_SUFFIX) as f:
                f.write(json.dumps({'replicas': self.replication.total,
                                    'global_batches': self.global_batches()}).encode())
        size = sum(os.path.getsize(p) for p in paths or () if os.path.isfile(p))
        self.last_snapshot_seconds = time.perf_counter() - start
        log.info('Snapshot of iteration %d written: %.3g MB in %.2f s', self.iter, size / 1e6,
                 self.last_snapshot_seconds)
        return paths

    def make_snapshot_layout(self):
        """Under --sync-bn, files are laid out as the user's prototxt (BatchNorm+Scale or BN)."""
        if self._user_train_param is None:
            return super().make_snapshot_layout()
        return UserLayout(self._user_train_param, self.net)

    def prefix_problem(self):
        """Process 0 writes the snapshots: it alone probes the prefix, and tells the others
        (each process probing too, one could remove what another made)."""
        problem = super().prefix_problem() if self.process == 0 else None
        if self.replication.link is not None:
            problem = self.replication.link.bcast_bytes((problem or '').encode()).decode()
        return problem or None

    def hold_prefix(self):
        """Process 0 writes the snapshots: it alone holds the prefix."""
        if self.process == 0:
            super().hold_prefix()

    @one_at_a_time('solve')
    def solve(self, resume_file=None):
        if self.strategy.follows_process_0():
            return self.strategy.follow()
        return super().solve(resume_file)

    @one_at_a_time('step')
    def step(self, iters):
        if not self.strategy.lockstep and self.nan_effect != 'none':
            raise CaffeError('-nan_effect %s needs synchronous updates: under -async each '
                             "replica's update is applied as it arrives, so there is no "
                             'iteration to stop or snapshot before' % self.nan_effect)
        if self.strategy.follows_process_0():
            return self.strategy.follow()
        return super().step(iters)

    def close(self):
        """End the replicas' threads (and the other processes' wait, under -async)."""
        self.strategy.close()
        self._release()
        super().close()


def _release(strategy, replicas, blas_limit):
    strategy.stop()
    replicas.close()
    if blas_limit is not None:
        blas_limit.restore_original_limits()
