"""Asynchronous data parallelism: replicas that do not wait for each other. A strategy of
the solver (see solver.py and synchronous.py for its methods).

Every replica loops on its own: it takes the shared params (and statistics) as they are
now, runs forward and backward on its own next batch, and hands its gradient to the one
parameter holder, which applies the solver's update rule to the shared params at once
and answers with them. A slow replica slows only its own updates; its gradients are
computed on params some updates old ("stale").

- The holder is the solver's own net, on process 0 (the net that tests and snapshots
  use), with the solver's update rule and history. Its updates are applied one at a time.
- An iteration is ``total`` updates (one per replica, on average), so ``max_iter``, the
  lr policy, ``display``, ``test_interval`` and ``snapshot`` count samples as the
  synchronous solver does. Each update is the rule applied to one replica's gradient
  divided by ``total`` (its share of a global batch). Between iterations the holder takes
  no updates: the replicas that finish meanwhile wait, so tests, snapshots and the log see
  params that nothing changes.
- ``max_staleness`` K: a replica does not start a step while it has made more than K
  updates beyond the slowest replica, so no two replicas' counts of updates ever differ
  by more than K + 1 (K = 0: rounds, in which every replica makes one update). None: no
  bound.
- Each replica keeps its own BN statistics while it computes and hands them over with its
  gradient (the last one in holds). Its losses divide by its own batch: replicas share
  nothing while they compute, so SyncBN is refused.
- Across MPI processes, each replica of another process has a proxy thread on process 0
  that receives its gradient and sends the params back (comm/mpi.py's polled waits), so
  remote and local replicas go through the same holder. The other processes only compute:
  their solver follows process 0 until process 0 closes its solver.
"""
import contextlib
import functools
import logging
import threading
import weakref
from concurrent import futures

import numpy as np

from ..backend import to_numpy
from ..syncbn_policy import check_asynchronous

log = logging.getLogger('caffe_syncbn')

_PUSH, _REPLY = 200, 201


class ParamHolder:
    """The shared params and the order of updates (see the module docstring)."""

    def __init__(self, solver, total, max_staleness, kept):
        self.solver, self.total, self.max_staleness = solver, total, max_staleness
        self.blobs = [blob for layer in solver.net.layers for blob in layer.blobs]
        self.learned = solver.net.learnable_params
        #: the blobs no update changes (statistics, frozen params): the replicas' own, handed in
        self.kept = kept
        # a replica's thread calls in with its own GPU current: work on the holder's
        device = getattr(self.blobs[0].data, 'device', None) if self.blobs else None
        self.on_device = device if hasattr(device, '__enter__') else contextlib.nullcontext()
        self.cond = threading.Condition()
        self.version = self.limit = 0
        self.clocks = [0] * total
        self.losses, self.staleness = [], []
        #: the most updates by which one replica was ever ahead of another
        self.spread = 0
        self.failure, self.closed = None, False

    def read(self):
        with self.cond, self.on_device:
            return self._params()

    def _params(self):
        return [to_numpy(blob.data).copy() for blob in self.blobs], self.version

    def push(self, rank, read_version, loss, gradients, kept):
        """Apply replica ``rank``'s gradient (computed on params of ``read_version``) as one
        update; return the params and their version, or None once the holder closed."""
        solver, scale = self.solver, 1.0 / self.total
        with self.cond:
            while self.version >= self.limit and not self.closed:
                self.cond.wait()
            if self.closed:
                return None
            with self.on_device:
                for blob, gradient in zip(self.learned, gradients):
                    blob.diff[...] = blob.xp.asarray(gradient) * blob.dtype.type(scale)
                for index, data in zip(self.kept, kept):
                    self.blobs[index].data[...] = self.blobs[index].xp.asarray(data)
                solver.update_params(solver.learning_rate())
            self.staleness.append(self.version - read_version)
            self.version += 1
            self.clocks[rank] += 1
            self.spread = max(self.spread, max(self.clocks) - min(self.clocks))
            self.losses.append(loss)
            self.cond.notify_all()
            while (self.max_staleness is not None and not self.closed and
                   self.clocks[rank] > min(self.clocks) + self.max_staleness):
                self.cond.wait()
            if self.closed:
                return None
            with self.on_device:
                return self._params()

    def run(self, updates, check):
        """Let ``updates`` more updates in and wait for them; their mean loss. ``check()``
        raises what a replica raised."""
        with self.cond:
            self.limit, self.losses = self.version + updates, []
            self.cond.notify_all()
            while self.version < self.limit:
                if self.failure is not None:
                    raise self.failure
                check()
                self.cond.wait(0.2)
            return float(np.mean(self.losses))

    def fail(self, exc):
        with self.cond:
            if self.failure is None:
                self.failure = exc
            self.closed = True
            self.cond.notify_all()

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class RemoteHolder:
    """The holder as a replica of another process sees it: MPI messages to process 0."""

    def __init__(self, link, rank):
        self.link, self.rank = link, rank

    def read(self):
        return self.link.recv_object(0, _REPLY + 2 * self.rank, 'the initial params')

    def push(self, rank, read_version, loss, gradients, kept):
        self.link.send_object((read_version, loss, gradients, kept), 0, _PUSH + 2 * rank,
                              'a gradient for process 0')
        return self.link.recv_object(0, _REPLY + 2 * rank, 'the params from process 0')


class Asynchronous:
    """The strategy of asynchronous updates (see the module docstring)."""

    #: the replicas take no steps together: each reads and updates at its own pace
    lockstep = False

    def __init__(self, solver, replicas, max_staleness=None):
        # weakly: the replicas' threads must not keep a dropped solver alive
        self.solver, self.replicas = weakref.proxy(solver), replicas
        self.max_staleness = max_staleness
        self.holder, self._loops, self._proxies = None, [], []

    def train_net(self, build_alone, root):
        """The holder: a net of its own on process 0 (the replicas compute on theirs)."""
        check_asynchronous(layers=root.layers)
        net = self.replicas.nets[0]
        updated = {id(b) for b, lr in zip(net.learnable_params, net.params_lr) if lr != 0}
        self._kept = [i for i, blob in enumerate(b for layer in net.layers for b in layer.blobs)
                      if id(blob) not in updated]
        if self.replicas.process != 0:
            return root
        holder = build_alone()
        for mine, theirs in zip(holder.layers, root.layers):   # replica 0's initial weights
            for blob, source in zip(mine.blobs, theirs.blobs):
                blob.data[...] = source.data
        return holder

    def start(self):
        if self.replicas.process == 0:
            self.holder = ParamHolder(self.solver, self.replicas.total, self.max_staleness,
                                      self._kept)

    def follows_process_0(self):
        return self.replicas.process != 0

    def broadcast_params(self):
        """Nothing to do: every replica reads the holder's params before each step."""

    def after_restore(self):
        pass

    # ---- process 0 ---------------------------------------------------------------------------
    def forward_backward_all(self):
        self._start_loops()
        return self.holder.run(self.replicas.total, self._check_loops)

    def forward_all(self):
        """The display pass after training: the mean loss of the last iteration's updates."""
        return float(np.mean(self.holder.losses)) if self.holder.losses else float('nan')

    def skipped_statistics(self):
        """None skipped: asynchronous training refuses SyncBN (syncbn_policy.check_asynchronous)."""
        return {}

    def update(self, rate):
        """Nothing to do: the holder applied the replicas' updates as they came in."""

    def _start_loops(self):
        if self._loops or self._proxies:
            return
        replicas, holder = self.replicas, self.holder
        for rank in range(len(replicas)):
            self._loops.append(replicas.pool.submit(rank, self._guarded, rank, holder))
        for rank, process in self._remote_replicas():
            thread = threading.Thread(target=self._proxy, args=(rank, process),
                                      name='async-proxy-%d' % rank, daemon=True)
            thread.start()
            self._proxies.append(thread)

    def _remote_replicas(self):
        """(rank, process) of every replica of the other processes."""
        replicas = self.replicas
        if replicas.link is None:
            return []
        owners = [p for p, count in enumerate(replicas.counts) for _ in range(count)]
        return [(rank, owners[rank]) for rank in range(replicas.total)
                if not replicas.first <= rank < replicas.first + len(replicas)]

    def _check_loops(self):
        for future in self._loops:
            if future.done() and future.exception() is not None:
                raise future.exception()

    def _proxy(self, rank, process):
        """A remote replica's stand-in on process 0: its gradients in, params out."""
        link, holder = self.replicas.link, self.holder
        try:
            link.send_object(holder.read(), process, _REPLY + 2 * rank, 'the initial params')
            while True:
                message = link.recv_object(process, _PUSH + 2 * rank, 'a gradient of replica %d'
                                           % rank)
                reply = holder.push(rank, *message)
                link.send_object(reply, process, _REPLY + 2 * rank, 'the params')
                if reply is None:
                    return
        except BaseException as exc:
            holder.fail(exc)

    # ---- every process -------------------------------------------------------------------------
    def _guarded(self, local_rank, holder):
        try:
            self._replica_loop(local_rank, holder)
        except BaseException as exc:
            if self.holder is not None:
                self.holder.fail(exc)
            raise

    def _replica_loop(self, local_rank, holder):
        solver, replicas = self.solver, self.replicas
        net, rank = replicas.nets[local_rank], replicas.first + local_rank
        blobs = [blob for layer in net.layers for blob in layer.blobs]
        learned = net.learnable_params
        state = holder.read()
        while state is not None:
            params, version = state
            for blob, data in zip(blobs, params):
                blob.data[...] = blob.xp.asarray(data)
            loss = float(solver.accumulate(net.clear_param_diffs, functools.partial(
                self._one_pass, local_rank, net), dtype=float))
            state = holder.push(rank, version, loss, [to_numpy(b.diff) for b in learned],
                                [to_numpy(blobs[i].data) for i in self._kept])

    def _one_pass(self, local_rank, net, last):
        self.solver.next_part(local_rank)
        return net.forward_backward()

    def follow(self):
        """The other processes: their replicas compute until process 0 closes."""
        if self._loops:
            return
        replicas = self.replicas
        self._loops = [replicas.pool.submit(rank, self._guarded, rank,
                                            RemoteHolder(replicas.link, replicas.first + rank))
                       for rank in range(len(replicas))]
        # the first to fail ends this process's part (and, through the launcher, the job)
        futures.wait(self._loops, return_when=futures.FIRST_EXCEPTION)
        for future in self._loops:
            if future.done() and future.exception() is not None:
                raise future.exception()
        for future in self._loops:
            future.result()

    def stop(self):
        """Let the replicas' loops end, without waiting for them."""
        if self.holder is not None:
            self.holder.close()

    def close(self):
        holder = self.holder
        if holder is None:
            return
        if not self._loops:      # no iteration ran: the other processes wait for params
            for rank, process in self._remote_replicas():
                self.replicas.link.send_object(None, process, _REPLY + 2 * rank,
                                               'the end of training')
        holder.close()
        for future in self._loops:
            try:
                future.result(timeout=60)
            except Exception:             # a failure was raised to the caller already
                pass
        for thread in self._proxies:
            thread.join(60)
        if holder.staleness:
            log.info('Asynchronous updates: %d, staleness (updates applied between a '
                     "replica's read and its update) mean %.2f, max %d", len(holder.staleness),
                     np.mean(holder.staleness), max(holder.staleness))

