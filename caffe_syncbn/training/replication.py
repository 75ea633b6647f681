"""Replication: the replicas of a data-parallel solver, a component the solver holds, as
Caffe's P2PSync sits beside its Solver.

``Replicas`` is where the replicas live: one worker thread per local device (DevicePool),
one communicator member per replica, the replica nets, and the input pipeline that reads
this process's share of each global batch. Across MPI processes (``link``, comm/mpi.py)
replica k of process p is global replica ``first + k`` of ``total``.

A strategy says how the replicas make updates:
- ``Synchronous``: every replica runs forward and backward on its part of one global
  batch; the gradients are summed in buckets that overlap backward (gradients.py) and
  averaged; every replica applies the same update, so params stay bitwise equal.
- ``Asynchronous`` (asynchronous.py): every replica computes on its own batches with the
  params it last read and hands its gradient to one parameter holder, without waiting.
"""
import functools

import numpy as np

from ..comm import SoloComm, ThreadComm, mpi
from ..comm.nccl import NcclComm
from ..comm.same_device import SameDeviceComm
from ..errors import CaffeError
from ..layer import LayerContext
from ..net import Net
from .devices import DevicePool
from .gradient_buckets import DEFAULT_BUCKET_BYTES, GradientBuckets
from .input_pipeline import InputPipeline, split_batch
from .solvers import Solver


def make_comms(devices, link=None):
    """One communicator member per local device: none to speak of for one device alone,
    threads on the CPU, NCCL across distinct GPUs, the same-GPU communicator when GPUs
    repeat (NCCL refuses two ranks on one GPU). With a ``link`` to other processes: a
    hierarchy on the CPU (threads here, MPI across), one NCCL communicator on GPUs."""
    kinds = {kind for kind, _ in devices}
    if len(kinds) > 1:
        raise CaffeError('devices mix CPU and GPU: %s' % (devices,))
    ids = [index for _, index in devices]
    if link is not None:
        if kinds == {'cpu'}:
            return mpi.ProcessGroupComm.create(link, len(devices))
        if len(set(ids)) != len(ids):
            raise CaffeError('devices %s repeat a GPU; across processes every replica needs '
                             'a GPU of its own (one NCCL rank per GPU)' % (devices,))
        return mpi.nccl_across_processes(link, ids)
    if len(devices) == 1:
        return SoloComm.create()
    if kinds == {'cpu'}:
        return ThreadComm.create(len(devices))
    if len(set(ids)) == 1:
        return SameDeviceComm.create(len(ids), ids[0])
    if len(set(ids)) != len(ids):
        raise CaffeError('devices %s repeat some GPUs but not all; use distinct GPUs or one GPU '
                         'repeated' % (devices,))
    return NcclComm.create_all(ids)


class Replicas:
    """The local replicas of a run and what they share (see the module docstring).
    ``communicate=False`` gives each replica a communicator of its own (asynchronous
    replicas meet only at the parameter holder)."""

    def __init__(self, devices, link=None, communicate=True):
        self.devices, self.link = devices, link
        self.process, self.processes = (link.rank, link.size) if link else (0, 1)
        #: how many replicas each process holds
        self.counts = link.allgather(len(devices)) if link else [len(devices)]
        if link is not None:
            kinds = link.allgather(devices[0][0] == 'gpu')
            if len(set(kinds)) > 1:
                raise CaffeError('the processes of this job train on different kinds of device '
                                 '(%s); give every process -gpu or every one -cpu_devices'
                                 % ', '.join('process %d: %s' % (p, 'GPU' if gpu else 'CPU')
                                             for p, gpu in enumerate(kinds)))
        self.first, self.total = sum(self.counts[:self.process]), sum(self.counts)
        self.communicate = communicate
        self.comms = make_comms(devices, link) if communicate else \
            [SoloComm() for _ in devices]
        self.pool = DevicePool(devices, self.comms)
        self.nets, self.pipeline, self.input_layers = [], None, []

    def __len__(self):
        return len(self.devices)

    def build(self, net_param, phase, seed, feeder, xp, dtype):
        """The replica nets, built one after another: the fillers share one seeded RNG, and
        replica 0 must draw the same weights whatever the number of devices (the others
        get its weights anyway). Each replica's own RNG (Dropout, ...) follows its global
        rank, so that any placement of the ranks draws alike."""
        def build_one(rank):
            rng = np.random.RandomState((seed + 7919 * (self.first + rank)) & 0xFFFFFFFF)
            context = LayerContext(phase=phase, xp=xp, dtype=dtype, comm=self.comms[rank],
                                   rng=rng, feeder=functools.partial(feeder, rank))
            return Net(net_param, phase, level=net_param.state.level, context=context)
        self.nets = [self.pool.run_on(rank, functools.partial(build_one, rank))
                     for rank in range(len(self))]
        root = self.nets[0]
        self.input_layers = [(layer.name, root.top_names[layer.name])
                             for layer in root.layers if layer.type == 'Input']
        return root

    def data_layers(self):
        return [layer for layer in self.nets[0].layers
                if hasattr(layer, 'make_reader') and layer.type != 'Input']

    def start_pipeline(self, seed, per_replica=False):
        """The input pipeline: this process's share of every global batch, its readers'
        random draws seeded alike in every process. ``per_replica``: one pipeline per
        replica, each reading that replica's rows of the successive global batches at its
        own pace (asynchronous replicas)."""
        layers = self.data_layers()
        if not layers:
            return
        rngs = [np.random.RandomState([seed & 0xFFFFFFFF, 1 + i]) for i in range(len(layers))]
        if per_replica:
            self.pipeline = [InputPipeline(layers, 1, place=(self.first + r, self.total),
                                           rngs=_copies(rngs)) for r in range(len(self))]
        else:
            self.pipeline = InputPipeline(layers, len(self), place=(self.first, self.total),
                                          rngs=rngs)

    def split_source(self, batch):
        """What set_data_source gave, as one dict per local replica: a dict of global
        arrays is split over all replicas of all processes, a list is one dict per local
        replica."""
        if isinstance(batch, dict):
            names = list(batch)
            pieces = split_batch([np.asarray(batch[n]) for n in names], self.total)
            return [dict(zip(names, piece)) for piece in pieces[self.first:self.first + len(self)]]
        if len(batch) != len(self):
            raise CaffeError('the data source gave %d per-replica batches for %d replicas'
                             % (len(batch), len(self)))
        return batch

    def source_parts(self, batch, parts):
        """Put the Input blobs of ``batch`` (split_source's form) into ``parts``."""
        self.input_parts(self.split_source(batch), parts)

    def input_parts(self, batches, parts):
        """Put the Input blobs of ``batches`` (one dict per replica) into ``parts``."""
        for rank, inputs in enumerate(batches):
            for name, tops in self.input_layers:
                missing = [t for t in tops if t not in inputs]
                if missing:
                    raise CaffeError("the data source gave no array for blob(s) %s of Input "
                                     "layer '%s'" % (', '.join(missing), name))
                parts[rank]['layers'][name] = [np.asarray(inputs[t]) for t in tops]

    def sum_over_all(self, values):
        """The sum over every replica of every process of ``values[k]`` (one per local
        replica, each a float or a numpy array), in global rank order."""
        arrays = [np.array(v, np.float64).reshape(-1) for v in values]
        if self.total == 1:
            return arrays[0]
        if self.processes == 1:
            total = arrays[0].copy()
            for a in arrays[1:]:
                total += a
            return total
        if not self.communicate:         # each replica's communicator holds it alone
            raise RuntimeError('replicas without communicators cannot sum across processes')
        return self.pool.run(lambda rank: self.comms[rank].allreduce(arrays[rank], tag='sums'))[0]

    def close(self):
        for pipeline in (self.pipeline if isinstance(self.pipeline, list) else [self.pipeline]):
            if pipeline is not None:
                pipeline.close()
        self.pool.close()
        for comm in self.comms:
            comm.close()


def _copies(rngs):
    copies = []
    for rng in rngs:
        copy = np.random.RandomState()
        copy.set_state(rng.get_state())
        copies.append(copy)
    return copies


class Synchronous:
    """One update from one global batch, the same on every replica (see the module doc)."""

    name = 'sync'
    #: about how many bytes of gradients go into one allreduce (gradients.py)
    gradient_bucket_bytes = DEFAULT_BUCKET_BYTES

    def __init__(self, solver):
        self.solver, self.replicas = solver, solver.replication
        self._buckets = [None] * len(self.replicas)

    def train_net(self, build_alone, root):
        """The solver's own net: replica 0's (the replicas stay equal to it)."""
        return root

    def start(self):
        self.broadcast_params()

    def follows_process_0(self):
        return False

    def broadcast_params(self):
        """Make every replica's blobs (params and statistics) equal to global replica 0's."""
        replicas = self.replicas

        def send(rank):
            for layer in replicas.nets[rank].layers:
                for blob in layer.blobs:
                    replicas.comms[rank].broadcast(blob.data, root=0, tag='params')
        replicas.pool.run(send)

    def forward_backward_all(self):
        solver, replicas = self.solver, self.replicas
        iter_size = solver.param.iter_size
        replicas.pool.run(lambda rank: replicas.nets[rank].clear_param_diffs())
        losses = np.zeros(len(replicas))
        for k in range(iter_size):
            solver.next_parts()
            last = k == iter_size - 1      # the gradients are final in the last pass only
            losses += replicas.pool.run(lambda rank: self._forward_backward(rank, last))
        if replicas.total > 1:
            replicas.pool.run(lambda rank: self._gradient_buckets(rank).finish())
        return float(replicas.sum_over_all(losses)[0]) / (iter_size * replicas.total)

    def _gradient_buckets(self, rank):
        if self._buckets[rank] is None:
            self._buckets[rank] = GradientBuckets(self.replicas.nets[rank],
                                                  self.replicas.comms[rank],
                                                  self.gradient_bucket_bytes)
        return self._buckets[rank]

    def _forward_backward(self, rank, reduce_gradients):
        overlap = reduce_gradients and self.replicas.total > 1
        return self.replicas.nets[rank].forward_backward(
            after_layer=self._gradient_buckets(rank).layer_done if overlap else None)

    def forward_all(self):
        """The display pass after training: a forward of every replica on the next batch."""
        replicas = self.replicas
        self.solver.next_parts()
        losses = replicas.pool.run(lambda rank: replicas.nets[rank].forward_prefilled())
        return float(replicas.sum_over_all(losses)[0]) / replicas.total

    def apply_update(self):
        solver = self.solver
        solvers = [solver] + solver.workers
        for worker in solver.workers:
            worker.iter = solver.iter
        # the same update on every replica (the root logs the rate)
        return self.replicas.pool.run(lambda rank: Solver.apply_update(solvers[rank]))[0]

    def after_restore(self):
        solver = self.solver
        for worker in solver.workers:
            worker.iter = solver.iter
            worker.lr_policy.current_step = solver.lr_policy.current_step
            for mine, root in zip(worker.rule.history, solver.rule.history):
                mine[...] = worker.xp.asarray(root) if worker.xp is not None else root
        self.broadcast_params()

    def close(self):
        pass
