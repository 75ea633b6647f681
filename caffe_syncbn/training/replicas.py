"""The replicas of a data-parallel solver, a component the solver holds, as Caffe's
P2PSync sits beside its Solver.

``Replicas`` is where the replicas live: one worker thread per local device
(``DevicePool``), one communicator member per replica (and one of its SyncBN group, under
``sync_bn_group_size``: comm/groups.py), the replica nets, the input
pipeline that reads this process's share of each global batch, and the parts of the batch
each replica reads next. Across MPI processes (``link``, comm/mpi.py) replica k of process
p is global replica ``first + k`` of ``total``. The replicas make updates in the way of a
strategy (synchronous.py, asynchronous.py). Nothing here refers back to the solver, so
a solver dropped without ``close()`` can be collected, and its threads end (``close``).
"""
import concurrent.futures as futures
import functools
import threading

import numpy as np

from ..backend.thread_start import start_workers
from ..comm import CommAborted, SoloComm, communicators
from ..comm.groups import Groups, group_communicators
from ..errors import CaffeError
from ..layer import LayerContext
from ..net import Net
from .input_pipeline import InputPipeline, split_batch

ABORT_GRACE_SECONDS = 5.0


class Replicas:
    """The local replicas of a run and what they share (see the module docstring).
    ``communicate=False`` gives each replica a communicator of its own (asynchronous
    replicas meet only at the parameter holder). ``group_size``: SyncBN layers share batch
    statistics within groups of that many consecutive global replicas (None: all)."""

    def __init__(self, devices, link=None, communicate=True, group_size=None):
        self.devices, self.link = devices, link
        self.process, self.processes = (link.rank, link.size) if link else (0, 1)
        #: how many replicas each process holds
        self.counts = link.allgather(len(devices)) if link else [len(devices)]
        if link is not None:
            kinds = link.allgather(devices[0].kind == 'gpu')
            if len(set(kinds)) > 1:
                raise CaffeError('the processes of this job train on different kinds of device '
                                 '(%s); give every process -gpu or every one -cpu_devices'
                                 % ', '.join('process %d: %s' % (p, 'GPU' if gpu else 'CPU')
                                             for p, gpu in enumerate(kinds)))
        self.first, self.total = sum(self.counts[:self.process]), sum(self.counts)
        self.communicate = communicate
        #: SyncBN's groups (comm/groups.py), or None: every replica shares its statistics
        self.groups = Groups(self.counts, group_size) \
            if group_size is not None and group_size != self.total else None
        self.comms = communicators(devices, link) if communicate else \
            [SoloComm() for _ in devices]
        #: the node of each process (MpiLink.nodes), for the lines that place the groups
        self.nodes = link.nodes() if link is not None and self.groups is not None else None
        self.group_comms = self.comms if self.groups is None else \
            group_communicators(devices, link, self.groups, self.first, self.comms)
        self.pool = DevicePool(devices, self._all_comms())
        self.nets, self.pipeline, self.input_layers = [], None, []
        #: what each replica's data layers read next: {layer name: arrays} per replica
        self.parts = [{} for _ in devices]
        self._source_lock = threading.Lock()

    def __len__(self):
        return len(self.devices)

    def _all_comms(self):
        return self.comms + (self.group_comms if self.group_comms is not self.comms else [])

    @property
    def group_size(self):
        """How many replicas share SyncBN's statistics."""
        return self.total if self.groups is None else self.groups.size

    def at_iteration(self, iteration):
        """Tell every communicator member the solver's iteration, which each collective
        then carries (comm/base.py): members an iteration apart fail as a mismatch."""
        for comm in self._all_comms():
            comm.iteration = iteration

    def build(self, net_param, phase, seed, xp, dtypes, memory_plan):
        """The replica nets, built one after another, of ``dtypes`` (LayerContext's dtype
        and activation_dtype): the fillers share one seeded RNG, and replica 0 must draw
        the same weights whatever the number of devices (the others get its weights
        anyway). Each replica's own RNG (Dropout, ...) follows its global rank, so that any
        placement of the ranks draws alike."""
        def build_one(rank):
            rng = np.random.RandomState((seed + 7919 * (self.first + rank)) & 0xFFFFFFFF)
            context = LayerContext(phase=phase, xp=xp, dtype=dtypes[0], comm=self.comms[rank],
                                   rng=rng, feeder=functools.partial(self._layer_feed, rank),
                                   group_comm=self.group_comms[rank], activation_dtype=dtypes[1])
            return Net(net_param, phase, level=net_param.state.level, context=context,
                       memory_plan=memory_plan)
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

    def next_parts(self, source=None):
        """The local replicas' parts of the next global batch: Input blobs from ``source``
        (set_data_source's: a dict of global arrays, split over all replicas, or a list of
        one dict per local replica), data layers from the pipeline."""
        parts = [{} for _ in range(len(self))]
        if source is not None:
            self._input_parts(self.split_source(source()), parts)
        if self.pipeline is not None:
            for rank, layers in enumerate(self.pipeline.next_split()):
                parts[rank].update(layers)
        self.parts = parts

    def next_part(self, rank, source=None):
        """Asynchronous replicas: replica ``rank``'s next batch of its own, from its pipeline
        or from one call of ``source`` (whose arrays are all that replica's)."""
        layers = {}
        if source is not None:
            with self._source_lock:
                batch = source()
            self._input_parts([batch], [layers])
        if self.pipeline is not None:
            layers.update(self.pipeline[rank].next_split()[0])
        self.parts[rank] = layers

    def _input_parts(self, batches, parts):
        """Put the Input blobs of ``batches`` (one dict per replica) into ``parts``."""
        for rank, inputs in enumerate(batches):
            for name, tops in self.input_layers:
                missing = [t for t in tops if t not in inputs]
                if missing:
                    raise CaffeError("the data source gave no array for blob(s) %s of Input "
                                     "layer '%s'" % (', '.join(missing), name))
                parts[rank][name] = [np.asarray(inputs[t]) for t in tops]

    def _layer_feed(self, rank, layer):
        parts = self.parts[rank]
        if layer.name in parts:
            return parts[layer.name]
        if layer.type != 'Input':
            raise CaffeError("data layer '%s' has no batch from the input pipeline" % layer.name)
        net = self.nets[rank]
        if self.total == 1 and self.communicate:
            # one replica that steps with the solver is Caffe's one net: what the caller
            # wrote into its Input blobs is the batch
            return [net.blobs[name].data for name in net.top_names[layer.name]]
        raise CaffeError("Input layer '%s' has no data for %d %sreplicas: blobs set by hand "
                         'feed a single device only; give the solver a source, '
                         'solver.set_data_source(lambda: {%s}), whose global batch is split '
                         'over the replicas, or the net a data layer (Data, ImageData, '
                         'HDF5Data, ...)' % (layer.name, self.total,
                                             '' if self.communicate else 'asynchronous ',
                                             ', '.join("'%s': ..." % name for name in
                                                       net.top_names[layer.name])))

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
        for comm in self._all_comms():
            comm.close()


def _copies(rngs):
    copies = []
    for rng in rngs:
        copy = np.random.RandomState()
        copy.set_state(rng.get_state())
        copies.append(copy)
    return copies


class DevicePool:
    """One long-lived worker thread per device; ``run(fn)`` calls ``fn(rank)`` on each.

    The threads start with the pool (a refused one is one CaffeError: thread_start.py).
    A worker thread keeps its device current (a CUDA context is per thread) with a stream
    of its own, so a replica's work always happens on the same thread and stream. A GPU
    does not order one stream's work with another's, so every call is a hand-over both
    ways: the caller's queued work is done before the replicas start, and each replica's
    is done before its result comes back. Then the caller reads what the replicas wrote
    (outputs, params for tests and snapshots) and writes what they will read (weights,
    Input blobs) on whatever stream it has.

    If one replica raises, the pool aborts the communicator, so replicas blocked in a
    collective raise promptly, and the caller gets the ORIGINAL exception with its
    traceback.
    """

    def __init__(self, devices, comms):
        self.devices = list(devices)
        self.comms = list(comms)
        self.size = len(self.devices)
        self._workers = []
        try:
            for rank, device in enumerate(self.devices):
                self._workers.append(futures.ThreadPoolExecutor(
                    1, thread_name_prefix='replica%d' % rank))
                start_workers(self._workers[-1], 1, 'the worker of replica %d (%s; %d replicas)'
                              % (rank, device, self.size))
        except CaffeError:
            self.close()
            raise
        self._distinct = list(dict.fromkeys(self.devices))

    def _finished(self, rank, fn, *args):
        """``fn(*args)`` on replica ``rank``'s thread, its queued work done on return."""
        result = fn(*args)
        self.devices[rank].synchronize()
        return result

    def _hand_over(self):
        for device in self._distinct:
            device.synchronize()

    def run(self, fn):
        """``[fn(0), ..., fn(R-1)]``, each on its replica's thread."""
        self._hand_over()
        pending = [worker.submit(self._finished, rank, fn, rank)
                   for rank, worker in enumerate(self._workers)]
        done, not_done = futures.wait(pending, return_when=futures.FIRST_EXCEPTION)
        failure = next((f.exception() for f in pending if f.done() and f.exception() is not None
                        and not isinstance(f.exception(), CommAborted)), None)
        if failure is None:
            failure = next((f.exception() for f in done if f.exception() is not None), None)
        if failure is None:
            return [f.result() for f in pending]
        for comm in self.comms:
            comm.abort(failure)
        _, stuck = futures.wait(not_done, timeout=ABORT_GRACE_SECONDS)
        original = next((f.exception() for f in pending if f.done() and f.exception() is not None
                         and not isinstance(f.exception(), CommAborted)), failure)
        if stuck:
            raise CaffeError('%d replica(s) did not stop within %.0f s after replica failure: %r'
                             % (len(stuck), ABORT_GRACE_SECONDS, original)) from original
        raise original

    def submit(self, rank, fn, *args):
        """Start ``fn(*args)`` on one replica's thread; its Future."""
        self._hand_over()
        return self._workers[rank].submit(self._finished, rank, fn, *args)

    def run_on(self, rank, fn):
        """``fn()`` on one replica's thread (no collectives: nothing to abort)."""
        return self.submit(rank, fn).result()

    def close(self):
        for worker in self._workers:
            worker.shutdown(wait=False)
