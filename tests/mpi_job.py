"""Checks that run inside an MPI job; tests/test_mpi.py launches them and reads what they
write. Several checks share one launch, because starting an MPI job on 2 cores is slow.

    mpiexec -n 2 python tests/mpi_job.py OUT equivalence groups pipelines nccl async prefix
    mpiexec -n 2 python tests/mpi_job.py OUT fault SOLVER     (FAULT=raise|kill|stop|skip, ...)

Each check writes OUT/<check>-rank<r>.npz; process 0 also writes the references that one
process computes alone (link=None) in the same launch.
"""
import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from caffe_syncbn.backend import to_numpy  # noqa: E402
from caffe_syncbn.comm.mpi import Channel, job_link  # noqa: E402
from caffe_syncbn.training.data_parallel import DataParallelSolver  # noqa: E402

STEPS = 4
SPLIT = (7, 0, 6, 3)          # uneven, with an empty replica (process 0's second)


# ---- 2 x 2 = 1 x 4 = 1 device --------------------------------------------------------------
def record_run(devices, dtype, link, split):
    """STEPS steps of the data-parallel test net: per step the loss, the averaged gradients
    and SyncBN's global statistics (its 1/std and count); then the params and the running
    statistics, all of the local replica 0."""
    from test_data_parallel import batches, solver_param
    solver = DataParallelSolver(solver_param(), devices=devices, dtype=dtype, link=link)
    first, local = solver.replication.first, len(solver.replication)
    bounds = np.cumsum([0] + list(split)) if split else None
    feed = iter(batches(STEPS, seed=3))

    def source():
        batch = next(feed)
        if bounds is None:
            return batch
        return [{k: v[bounds[g]:bounds[g + 1]] for k, v in batch.items()}
                for g in range(first, first + local)]

    solver.set_data_source(source)
    out = {}
    for step in range(STEPS):
        out['loss/%d' % step] = solver.forward_backward_all()
        for i, blob in enumerate(solver.net.learnable_params):
            out['gradient/%d/%d' % (step, i)] = to_numpy(blob.diff).copy()
        bn = solver.net.layer_by_name['bn']
        out['inv_std/%d' % step] = to_numpy(bn._inv_std).ravel().copy()
        out['count/%d' % step] = bn._count
        solver.apply_update()
        solver.iter += 1
    for i, blob in enumerate(solver.net.learnable_params):
        out['param/%d' % i] = to_numpy(blob.data).copy()
    for i, blob in enumerate(solver.net.params['bn']):
        out['running/%d' % i] = to_numpy(blob.data).copy()
    replicas_equal = all(np.array_equal(to_numpy(a.data), to_numpy(b.data))
                         for net in solver.replicas[1:]
                         for a, b in zip(net.learnable_params, solver.net.learnable_params))
    out['replicas_equal'] = replicas_equal
    solver.close()
    return out


def equivalence(out, link):
    for dtype in ('float64', 'float32'):
        devices = os.environ.get('DEVICES_PER_PROCESS', '2')
        split = SPLIT if link.size * int(devices) == len(SPLIT) else None
        np.savez(out / ('equivalence-%s-rank%d.npz' % (dtype, link.rank)),
                 **record_run('cpu:' + devices, dtype, link, split))
        if link.rank == 0 and os.environ.get('REFERENCES', '1') == '1':
            np.savez(out / ('equivalence-%s-1x4.npz' % dtype),
                     **record_run('cpu:4', dtype, None, SPLIT))
            np.savez(out / ('equivalence-%s-1x1.npz' % dtype),
                     **record_run('cpu:1', dtype, None, None))
        link.barrier()


# ---- SyncBN in groups --------------------------------------------------------------------------
GROUP_SIZE = 2


def record_groups(devices, link):
    """STEPS steps of the data-parallel test net with SyncBN in groups of GROUP_SIZE: every
    local replica's learned params and running statistics, by global replica."""
    from test_data_parallel import batches, solver_param
    solver = DataParallelSolver(solver_param(), devices=devices, dtype='float64', link=link,
                                sync_bn_group_size=GROUP_SIZE)
    first = solver.replication.first
    feed = iter(batches(STEPS, seed=5))
    solver.set_data_source(lambda: next(feed))
    solver.step(STEPS)
    out = {}
    for k, net in enumerate(solver.replicas):
        for i, blob in enumerate(net.learnable_params):
            out['%d/%d' % (first + k, i)] = to_numpy(blob.data).copy()
    solver.close()
    return out


def groups(out, link):
    """Groups of 2 replicas in 2 processes of 2 (each group within a process) or in 4 of 1
    (each group two whole processes, over a link of their own); process 0 also computes 1
    process of 4 in groups of 2. The messages each process sends for SyncBN's layer 'bn'
    over MPI are counted (none where every group is within a process)."""
    sent = []
    for name in ('send', 'bcast', 'allgather_bytes'):
        def counting(self, *args, _original=getattr(Channel, name), _name=name):
            what = args[-1] if _name != 'allgather_bytes' else ''
            sent.append((_name, what))
            return _original(self, *args)
        setattr(Channel, name, counting)
    devices = os.environ.get('DEVICES_PER_PROCESS', '2')
    mine = record_groups('cpu:' + devices, link)
    mine['bn_messages'] = sum("'bn'" in what for _, what in sent)
    mine['messages'] = len(sent)
    np.savez(out / ('groups-rank%d.npz' % link.rank), **mine)
    if link.rank == 0 and os.environ.get('REFERENCES', '1') == '1':
        np.savez(out / 'groups-1x4.npz', **record_groups('cpu:4', None))
    link.barrier()


# ---- the input pipeline ----------------------------------------------------------------------
PIPELINE_BATCH = 2
PIPELINE_STEPS = 3


def pipelines(out, link):
    """The global batches of LMDB, HDF5 and image-list pipelines, read by 2 processes of 2
    replicas (this process's rows), and by one process of 4 replicas and of 1 replica with
    the whole global batch (process 0); with shuffling, random crops and mirrors; and how
    many samples each process decoded."""
    import caffe_syncbn.layers.data.image_data as image_data
    from caffe_syncbn import TRAIN, Net
    from caffe_syncbn.training.input_pipeline import InputPipeline
    folder = Path(os.environ['PIPELINE_DATA'])
    decoded = {'count': 0}
    for name in ('parse_datum', 'load_list_image'):
        original = getattr(image_data, name)

        def counting(*args, _original=original, **kwargs):
            if threading.current_thread() is threading.main_thread():   # not a prefetcher
                decoded['count'] += 1
            return _original(*args, **kwargs)
        setattr(image_data, name, counting)
    for kind in ('lmdb', 'hdf5', 'list'):
        def read(batch, replicas, place):
            net = Net(str(folder / ('%s-%d.prototxt' % (kind, batch))), TRAIN)
            layer = net.layers[0]
            pipeline = InputPipeline([layer], replicas, place=place, prefetch=1,
                                     rngs=[np.random.RandomState([7, 1])])
            steps = [pipeline.next_split() for _ in range(PIPELINE_STEPS)]
            pipeline.close()
            arrays = {}
            for step, parts in enumerate(steps):
                for top in range(2):
                    arrays['%d/%d' % (step, top)] = np.concatenate(
                        [part[layer.name][top] for part in parts])
            return arrays

        mine = read(PIPELINE_BATCH, 2, (2 * link.rank, 4))
        mine['decoded'] = decoded_share(folder / ('%s-%d.prototxt' % (kind, PIPELINE_BATCH)),
                                        link.rank, decoded)
        np.savez(out / ('pipeline-%s-rank%d.npz' % (kind, link.rank)), **mine)
        if link.rank == 0:
            np.savez(out / ('pipeline-%s-1x4.npz' % kind), **read(PIPELINE_BATCH, 4, None))
            np.savez(out / ('pipeline-%s-1x1.npz' % kind), **read(4 * PIPELINE_BATCH, 1, None))
        link.barrier()


def decoded_share(prototxt, process, decoded):
    """How many samples a process decodes for its 2 replicas' rows of PIPELINE_STEPS global
    batches (read_parts as the pipeline calls it, without its read-ahead thread)."""
    from caffe_syncbn import TRAIN, Net
    from caffe_syncbn.training.input_pipeline import read_parts
    layer = Net(str(prototxt), TRAIN).layers[0]
    reader = layer.make_reader(np.random.RandomState([7, 1]))
    decoded['count'] = 0
    for _ in range(PIPELINE_STEPS):
        read_parts(reader, [PIPELINE_BATCH] * 2, (2 * process * PIPELINE_BATCH, 4 * PIPELINE_BATCH))
    return decoded['count']


# ---- one NCCL communicator over the GPUs of every process (fake NCCL) --------------------------
def nccl(out, link):
    from helpers import fake_nccl

    from caffe_syncbn.comm.mpi import nccl_across_processes
    from helpers.host_streams import HostStreams
    made = []
    original = fake_nccl.NcclCommunicator.__init__

    def recording(self, ndev, commId, rank):
        made.append((ndev, commId, rank))
        original(self, ndev, commId, rank)
    fake_nccl.NcclCommunicator.__init__ = recording
    members = nccl_across_processes(link, [0, 1], nccl=fake_nccl,
                                    streams_for=lambda device: HostStreams())
    np.savez(out / ('nccl-rank%d.npz' % link.rank),
             ndev=[m[0] for m in made], rank=[m[2] for m in made],
             uid=[np.frombuffer(m[1], np.uint8) for m in made],
             member_rank=[m.rank for m in members], member_size=[m.size for m in members])
    link.barrier()


# ---- asynchronous updates across processes ---------------------------------------------------
def asynchronous(out, link):
    """12 iterations with a bound of 1 on 2 x 2 replicas, replica 1 (process 0) slowed."""
    import time

    from test_data_parallel import solver_param
    solver = DataParallelSolver(solver_param('BN'), devices='cpu:2', mode='async',
                                max_staleness=1, link=link)
    rs = np.random.RandomState(link.rank)
    slow = solver.replicas[1].forward_backward if link.rank == 0 else None
    if slow is not None:
        solver.replicas[1].forward_backward = lambda *a, **k: (time.sleep(0.01), slow(*a, **k))[1]
    solver.set_data_source(lambda: {'data': rs.standard_normal((4, 3, 8, 8)),
                                    'label': rs.randint(0, 5, 4).astype(float)})
    solver.step(12)
    result = {'iter': solver.iter}
    holder = solver.strategy.holder
    if holder is not None:
        result.update(version=holder.version, clocks=holder.clocks, spread=holder.spread,
                      staleness=holder.staleness)
    solver.close()
    # process 0 ends without an iteration (a resume at max_iter): the others, which wait
    # for their first params, end with it
    solver = DataParallelSolver(solver_param('BN'), devices='cpu:2', mode='async', link=link)
    solver.step(0)
    solver.close()
    np.savez(out / ('async-rank%d.npz' % link.rank), **result)
    link.barrier()


# ---- faults ------------------------------------------------------------------------------------
def fault(out, link, solver_path):
    """caffe-syncbn train on 2 replicas per process with a fault on one rank: FAULT is
    raise, kill (SIGKILL), stop (SIGSTOP) or skip (the replicas of FAULT_RANK skip the
    allreduce of SyncBN layer FAULT_WHERE at their FAULT_AT-th forward, as a layer run on
    some processes only); else FAULT_WHERE is forward (in a collective), reader (in the
    input pipeline) or snapshot (rank 0, halfway through the solverstate); FAULT_RANK the
    process; FAULT_AT the call that fails."""
    import caffe_syncbn.formats.solverstate as state
    import caffe_syncbn.training.snapshot_layout as snapshot_layout
    from caffe_syncbn.cli import main
    from caffe_syncbn.cli.common import run_main
    from caffe_syncbn.layers.data.layers import HDF5Reader
    from caffe_syncbn.net import Net
    what, where = os.environ['FAULT'], os.environ['FAULT_WHERE']
    at = int(os.environ.get('FAULT_AT', 3))
    mine = link.rank == int(os.environ['FAULT_RANK'])
    calls = {'n': 0}

    def strike():
        if what == 'raise':
            raise ValueError('injected fault on rank %d' % link.rank)
        os.kill(os.getpid(), signal.SIGKILL if what == 'kill' else signal.SIGSTOP)

    def at_call(original):
        def wrapper(self, *args, **kwargs):
            calls['n'] += 1
            if mine and calls['n'] == at:
                strike()
            return original(self, *args, **kwargs)
        return wrapper

    if what == 'skip':
        from caffe_syncbn.layers.norm.batch_norm import SyncBN
        share, forwards = SyncBN.share, {}

        def skipping(self, packed):
            if self.name == where and packed.size % 2:        # a forward's 1 + 2C sums
                forwards[id(self)] = forwards.get(id(self), 0) + 1
                if mine and forwards[id(self)] == at:
                    return None
            return share(self, packed)
        SyncBN.share = skipping
    elif where == 'forward':
        Net.forward_backward = at_call(Net.forward_backward)
    elif where == 'reader':
        HDF5Reader.next_batch = at_call(HDF5Reader.next_batch)
    elif where == 'snapshot' and mine:
        def half_written(path, solver_state):
            with state.atomic_write(path) as f:
                f.write(state._to_proto(solver_state).SerializeToString()[:16])
                f.flush()
                strike()
        snapshot_layout.write_solver_state = half_written
    mode = '-async' if os.environ.get('FAULT_MODE') == 'async' else '-sync_bn'
    run_main(lambda: main(['train', '-solver', solver_path, '-cpu_devices', '2', mode]))


# ---- the snapshot prefix -----------------------------------------------------------------------
def prefix(out, link):
    """How many probes of the snapshot prefix each process makes, the lock file's text
    while the solver lives (and this process's id), and the error each raises when process
    0 alone finds the prefix unwritable (a stand-in verdict)."""
    import tempfile

    import caffe_syncbn.training.solver as solver_module
    from caffe_syncbn.errors import CaffeError
    from test_data_parallel import solver_param
    param = solver_param()
    param.snapshot, param.snapshot_prefix = 1, str(out / 'shared')
    probes, mkstemp = [], tempfile.mkstemp

    def counting(*args, **kwargs):
        probes.append(kwargs.get('prefix'))
        return mkstemp(*args, **kwargs)
    tempfile.mkstemp = counting
    try:
        solver = DataParallelSolver(param, devices='cpu:1', link=link)
        lock = (out / 'shared.lock').read_text()
        link.barrier()                     # process 0's close removes the file
        solver.close()
    finally:
        tempfile.mkstemp = mkstemp
    if link.rank == 0:
        solver_module.snapshot_prefix_problem = lambda path: 'planted: no room at %s' % path
    error = ''
    try:
        DataParallelSolver(param, devices='cpu:1', link=link).close()
    except CaffeError as exc:
        error = str(exc)
    np.savez(out / ('prefix-rank%d.npz' % link.rank), probes=len(probes), error=error, lock=lock,
             pid=os.getpid())


def uncaught(link):
    """A script of the Python API whose rank 1 raises after 2 steps, uncaught."""
    from test_data_parallel import batches, solver_param
    solver = DataParallelSolver(solver_param(), devices='cpu:2', link=link)
    data = iter(batches(4))
    solver.set_data_source(lambda: next(data))
    solver.step(2)
    if link.rank == 1:
        raise ValueError('uncaught on rank 1')
    solver.step(2)


def main():
    out = Path(sys.argv[1])
    link = job_link()
    if link is None:
        sys.exit('mpi_job.py runs under mpiexec with 2 or more processes')
    checks = sys.argv[2:]
    if checks[0] == 'fault':
        return fault(out, link, checks[1])
    if checks[0] == 'uncaught':
        return uncaught(link)
    for check in checks:
        {'equivalence': equivalence, 'groups': groups, 'pipelines': pipelines, 'nccl': nccl,
         'async': asynchronous, 'prefix': prefix}[check](out, link)
    link.close()


if __name__ == '__main__':
    main()
