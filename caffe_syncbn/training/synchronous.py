"""Synchronous data parallelism: one update from one global batch, the same on every replica.

Every replica runs forward and backward on its part of the global batch; the gradients
are summed in buckets that overlap backward (gradient_buckets.py) and averaged, so they
are the gradient of one device on the whole batch; every replica applies the same update
(a ``ParamUpdate`` of its own, with the same history), so params stay bitwise equal.
The replicas' losses and the counts of the SyncBN updates they skipped (non-finite batch
statistics) are summed over every replica in one collective.
It is a strategy of the solver (see solver.py): ``forward_backward_all``,
``skipped_statistics``, ``forward_all``, ``update``; and, for the data-parallel solver,
``lockstep``, ``start``, ``train_net``, ``broadcast_params``, ``after_restore``,
``follows_process_0``, ``close`` and ``stop`` (``close`` without waiting: for a solver
collected without ``close()``).
"""
import weakref

import numpy as np

from ..backend import get_array_module, to_numpy
from .gradient_buckets import DEFAULT_BUCKET_BYTES, GradientBuckets
from .rules import ParamUpdate
from .solver_checks import skipped_by_layer, take_skipped


class Synchronous:
    """The strategy of synchronous updates (see the module docstring)."""

    #: the replicas take every step together, on their parts of one global batch
    lockstep = True
    #: about how many bytes of gradients go into one allreduce (gradient_buckets.py)
    gradient_bucket_bytes = DEFAULT_BUCKET_BYTES

    def __init__(self, solver, replicas):
        # weakly: the replicas' threads must not keep a dropped solver alive
        self.solver, self.replicas = weakref.proxy(solver), replicas
        self._buckets = [None] * len(replicas)
        self.updaters = []
        self._skipped = {}

    def train_net(self, build_alone, root):
        """The solver's own net: replica 0's (the replicas stay equal to it)."""
        return root

    def start(self):
        """The other replicas' updates (replica 0's is the solver's), each made on its
        replica's thread (its history on the replica's device), and equal params."""
        solver, nets = self.solver, self.replicas.nets
        self.updaters = self.replicas.pool.run(
            lambda rank: ParamUpdate(solver.param, nets[rank], solver.rule_class, solver.dtype)
            if rank else solver.updater)
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
        replicas, solver = self.replicas, self.solver
        replicas.at_iteration(solver.iter)
        losses = solver.accumulate(
            lambda: replicas.pool.run(lambda rank: replicas.nets[rank].clear_param_diffs()),
            self._one_pass, dtype=np.float64)
        if replicas.total > 1:
            replicas.pool.run(lambda rank: self._gradient_buckets(rank).finish())
        # summed in global rank order, so any placement of the replicas gives the same bits
        totals = replicas.sum_over_all([np.concatenate([[loss], take_skipped(net)])
                                        for loss, net in zip(losses, replicas.nets)])
        self._skipped = skipped_by_layer(replicas.nets[0], totals[1:], replicas.group_size,
                                         replicas.total // replicas.group_size *
                                         solver.param.iter_size)
        return float(totals[0]) / replicas.total

    def skipped_statistics(self):
        """{layer: (updates skipped, of updates)} of the last forward_backward_all."""
        return self._skipped

    def _one_pass(self, last):
        """Every replica's pass on its part of the next global batch; their losses. The
        gradients are reduced in the last pass only: they are final then."""
        self.solver.next_parts()
        return np.array(self.replicas.pool.run(lambda rank: self._forward_backward(rank, last)),
                        np.float64)

    def _gradient_buckets(self, rank):
        if self._buckets[rank] is None:
            self._buckets[rank] = GradientBuckets(self.replicas.nets[rank],
                                                  self.replicas.comms[rank],
                                                  self.gradient_bucket_bytes)
        return self._buckets[rank]

    def _forward_backward(self, rank, reduce_gradients):
        overlap = reduce_gradients and self.replicas.total > 1
        net = self.replicas.nets[rank]
        net.loss_scale = self.solver.loss_scale.value
        return net.forward_backward(
            after_layer=self._gradient_buckets(rank).layer_done if overlap else None)

    def forward_all(self):
        """The display pass after training: a forward of every replica on the next batch."""
        replicas = self.replicas
        self.solver.next_parts()
        losses = replicas.pool.run(lambda rank: replicas.nets[rank].forward_prefilled())
        return float(replicas.sum_over_all(losses)[0]) / replicas.total

    def update(self, rate):
        """The same update on every replica (replica 0's is the solver's, which logs)."""
        solver = self.solver
        self.replicas.pool.run(lambda rank: solver.update_params(rate) if rank == 0
                               else self.updaters[rank].apply(rate, solver.iter))

    def after_restore(self):
        """The restored history of replica 0's update in every replica's, each copied on
        its replica's thread (its device); then replica 0's params everywhere."""
        history = [to_numpy(h) for h in self.solver.rule.history]

        def copy(rank):
            for mine, root in zip(self.updaters[rank].rule.history, history):
                mine[...] = get_array_module(mine).asarray(root)
        self.replicas.pool.run(copy)
        self.broadcast_params()

    def close(self):
        pass

    def stop(self):
        """Nothing waits on anything between iterations."""
