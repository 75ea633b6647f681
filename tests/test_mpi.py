"""Training across MPI processes: mpiexec jobs of tests/mpi_job.py, 2 processes of 2
virtual CPU devices each, against one process of 4 devices and one device.

One launch runs several checks (starting MPI jobs on 2 cores is slow); the jobs skip only
where mpiexec is missing (`make test` installs it with the [test] extra).
"""
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import watchdog
from helpers.host_streams import HostStreams

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / 'tests' / 'mpi_job.py'
MPIEXEC = shutil.which('mpiexec', path=os.path.dirname(sys.executable) + os.pathsep +
                       os.environ.get('PATH', ''))
needs_mpi = pytest.mark.skipif(
    MPIEXEC is None, reason="mpiexec not found: pip install '.[mpi]' (make test installs it)")


def launch(out, *args, processes=2, env=None, limit=240):
    """``mpiexec -n processes python tests/mpi_job.py out args``, which must end as it
    would within ``limit`` seconds on an idle machine (see tests/helpers/watchdog.py): a job left
    hanging stalls or spins, at any load."""
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return watchdog.run([MPIEXEC, '-n', str(processes), sys.executable, str(JOB), str(out),
                         *map(str, args)], capture_output=True, text=True, limit=limit,
                        env=environment, cwd=ROOT)


def pipeline_data(folder):
    """An LMDB of raw Datum, an HDF5 list and an image list of two image sizes, and a
    prototxt per source and batch size (2 per device, and 8 for one device)."""
    import cv2
    import h5py

    from caffe_syncbn.data.datum import array_to_datum, write_lmdb
    folder.mkdir()
    rs = np.random.RandomState(0)
    images = rs.randint(0, 256, (13, 3, 7, 7)).astype(np.uint8)
    write_lmdb(str(folder / 'db'), [[(b'%04d' % i, array_to_datum(im, i).SerializeToString())
                                     for i, im in enumerate(images)]])
    with h5py.File(folder / 'a.h5', 'w') as f:
        f['data'] = rs.standard_normal((11, 2, 3, 3))
        f['label'] = np.arange(11.0)
    (folder / 'h5.txt').write_text(str(folder / 'a.h5') + '\n')
    lines = []
    for i in range(9):
        shape = (10, 10, 3) if i % 2 else (12, 9, 3)
        cv2.imwrite(str(folder / ('%d.png' % i)), rs.randint(0, 256, shape).astype(np.uint8))
        lines.append('%d.png %d' % (i, i))
    (folder / 'list.txt').write_text('\n'.join(lines) + '\n')
    layers = {
        'lmdb': 'type: "Data" data_param { source: "%s" backend: LMDB batch_size: %%d } '
                'transform_param { crop_size: 5 mirror: true scale: 0.5 }' % (folder / 'db'),
        'hdf5': 'type: "HDF5Data" hdf5_data_param { source: "%s" batch_size: %%d shuffle: true }'
                % (folder / 'h5.txt'),
        'list': 'type: "ImageData" image_data_param { source: "%s" root_folder: "%s/" '
                'batch_size: %%d shuffle: true } transform_param { crop_size: 8 mirror: true }'
                % (folder / 'list.txt', folder)}
    for kind, layer in layers.items():
        for batch in (2, 8):
            (folder / ('%s-%d.prototxt' % (kind, batch))).write_text(
                'layer { name: "data" top: "data" top: "label" %s }' % (layer % batch))
    return folder


@pytest.fixture(scope='module')
def job(tmp_path_factory):
    """One launch of the equivalence, pipeline, NCCL, asynchronous and prefix checks."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found: pip install '.[mpi]' (make test installs it)")
    out = tmp_path_factory.mktemp('mpi')
    data = pipeline_data(out / 'data')
    result = launch(out, 'equivalence', 'groups', 'pipelines', 'nccl', 'async', 'prefix',
                    env={'PIPELINE_DATA': str(data)})
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_a_job_is_recognized_from_its_launcher(monkeypatch):
    """MPI starts only where a launcher started several processes."""
    from caffe_syncbn.comm.mpi import launched_processes
    for name in ('PMI_SIZE', 'OMPI_COMM_WORLD_SIZE', 'MV2_COMM_WORLD_SIZE',
                 'SLURM_STEP_NUM_TASKS', 'PMIX_SIZE'):
        monkeypatch.delenv(name, raising=False)
    assert launched_processes() == 1
    monkeypatch.setenv('PMI_SIZE', '1')
    assert launched_processes() == 1
    monkeypatch.setenv('SLURM_STEP_NUM_TASKS', '4')
    assert launched_processes() == 4


# ---- equivalence ---------------------------------------------------------------------------------
QUANTITIES = ('loss', 'gradient', 'inv_std', 'count', 'param', 'running')


def max_differences(a, b):
    """{quantity: max |a - b|} over the recorded arrays of two runs."""
    worst = dict.fromkeys(QUANTITIES, 0.0)
    for key in a:
        if key != 'replicas_equal':
            worst[key.split('/')[0]] = max(worst[key.split('/')[0]],
                                           float(np.max(np.abs(a[key] - b[key]))))
    return worst


@pytest.mark.parametrize('dtype, tolerance', [('float64', 1e-10), ('float32', 1e-5)])
def test_two_processes_of_two_devices_equal_one_process_and_one_device(job, dtype, tolerance):
    """Uneven split (7, 0 | 6, 3) with an empty replica: 2 x 2 gives bitwise the numbers of
    1 x 4 (the same global rank order), and 1 x 1 on the whole batch within the tolerance;
    gradients, SyncBN's global statistics, params and running statistics, after 4 steps."""
    ranks = [load(job / ('equivalence-%s-rank%d.npz' % (dtype, r))) for r in range(2)]
    four, one = (load(job / ('equivalence-%s-%s.npz' % (dtype, p))) for p in ('1x4', '1x1'))
    for rank in ranks:
        assert bool(rank['replicas_equal'])
        assert max(max_differences(rank, four).values()) == 0.0
    assert max(max_differences(ranks[0], one).values()) <= tolerance
    assert max_differences(ranks[0], one)['param'] > 0    # the sums do differ from one device's


@needs_mpi
def test_four_processes_of_one_device_equal_one_process_of_four(tmp_path, job):
    """The same 4 replicas as 4 processes of 1: bitwise the numbers of 1 process of 4; and
    in SyncBN groups of 2, each group two whole processes that exchange SyncBN's sums over
    an MPI communicator of their own (MpiLink.split), bitwise those of 1 process in groups
    of 2."""
    result = launch(tmp_path, 'equivalence', 'groups', processes=4,
                    env={'DEVICES_PER_PROCESS': '1', 'REFERENCES': '0'})
    assert result.returncode == 0, result.stderr[-3000:]
    for dtype in ('float64', 'float32'):
        four = load(job / ('equivalence-%s-1x4.npz' % dtype))
        for rank in range(4):
            mine = load(tmp_path / ('equivalence-%s-rank%d.npz' % (dtype, rank)))
            assert max(max_differences(mine, four).values()) == 0.0
    check_groups([load(tmp_path / ('groups-rank%d.npz' % r)) for r in range(4)], job)
    assert all(int(load(tmp_path / ('groups-rank%d.npz' % r))['bn_messages']) > 0
               for r in range(4))


# ---- SyncBN in groups ----------------------------------------------------------------------------
def check_groups(ranks, job):
    """Every global replica's learned params of ``ranks`` (each process's groups-rank*.npz)
    equal those of 1 process of 4 in the same groups, bitwise."""
    reference = load(job / 'groups-1x4.npz')
    seen = set()
    for rank in ranks:
        for key, value in rank.items():
            if '/' in key:
                assert np.array_equal(value, reference[key]), key
                seen.add(key)
    assert seen == set(reference)


def test_groups_within_processes_exchange_nothing_for_syncbn_between_processes(job):
    """2 processes of 2 replicas in SyncBN groups of 2: each group is the threads of one
    process, so SyncBN's sums never touch MPI (the gradients still do), and every replica
    ends bitwise as in 1 process of 4 in groups of 2."""
    ranks = [load(job / ('groups-rank%d.npz' % r)) for r in range(2)]
    check_groups(ranks, job)
    assert [int(r['bn_messages']) for r in ranks] == [0, 0]
    assert all(int(r['messages']) > 0 for r in ranks)


TWO_NORMS = ('layer { name: "conv2" type: "Convolution" bottom: "conv" top: "conv2" '
             'convolution_param { num_output: 4 kernel_size: 1 '
             'weight_filler { type: "xavier" } } }\n'
             'layer { name: "bn2" type: "BatchNorm" bottom: "conv2" top: "conv2" }\n'
             'layer { name: "ip" type: "InnerProduct" bottom: "conv2"')


@needs_mpi
def test_a_process_that_skips_a_syncbn_layer_stops_every_process_naming_both_layers(tmp_path):
    """Process 1's replicas skip the allreduce of SyncBN 'bn' at their third forward
    (iteration 2), so their next collective is 'bn2''s: every process stops with one line
    naming what each process called, and none waits for a timeout (the timeouts are set
    far beyond what the watchdog lets the job take)."""
    from test_train_net import make_job
    solver = make_job(tmp_path / 'job', 2, max_iter=4)
    net = tmp_path / 'job' / 'net.prototxt'
    net.write_text(net.read_text().replace(
        'layer { name: "ip" type: "InnerProduct" bottom: "conv"', TWO_NORMS))
    result = launch(tmp_path, 'fault', solver, limit=30,
                    env={'FAULT': 'skip', 'FAULT_WHERE': 'bn', 'FAULT_RANK': '1',
                         'FAULT_AT': '3', 'CAFFE_SYNCBN_PEER_TIMEOUT': '3600',
                         'CAFFE_SYNCBN_COLLECTIVE_TIMEOUT': '3600'})
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if 'error:' in line]
    named = [line for line in lines if 'processes issued different collectives' in line]
    assert named, result.stderr[-3000:]
    for line in named:
        assert "process 0 called allreduce 'bn' (float64, shape (9,)) at iteration 2" in line
        assert "process 1 called allreduce 'bn2' (float64, shape (9,)) at iteration 2" in line
    assert not any('timed out' in line or 'heartbeat' in line for line in lines)


# ---- the input pipeline ------------------------------------------------------------------------
@pytest.mark.parametrize('kind', ['lmdb', 'hdf5', 'list'])
def test_processes_read_exactly_the_global_batch_and_only_their_share(job, kind):
    """Shuffled, randomly cropped and mirrored: the rows of 2 processes x 2 replicas make up
    the global batches of 1 process x 4 replicas and of 1 replica of batch 8, bitwise; each
    process decodes its own 4 samples per batch and no other."""
    ranks = [load(job / ('pipeline-%s-rank%d.npz' % (kind, r))) for r in range(2)]
    for reference in ('1x4', '1x1'):
        whole = load(job / ('pipeline-%s-%s.npz' % (kind, reference)))
        for key, array in whole.items():
            assert np.array_equal(np.concatenate([ranks[0][key], ranks[1][key]]), array), key
    if kind != 'hdf5':                  # HDF5 rows are read, not decoded
        assert [int(r['decoded']) for r in ranks] == [3 * 4, 3 * 4]


# ---- NCCL ----------------------------------------------------------------------------------------
def test_one_nccl_communicator_spans_the_gpus_of_every_process(job):
    """Process 0's unique id (CuPy 14's bytes, which the strict fake NCCL requires) reaches
    process 1 over MPI; the 4 ranks join one communicator of 4 at their global ranks."""
    ranks = [load(job / ('nccl-rank%d.npz' % r)) for r in range(2)]
    assert [list(r['rank']) for r in ranks] == [[0, 1], [2, 3]]
    assert [list(r['member_rank']) for r in ranks] == [[0, 1], [2, 3]]
    assert all(list(r['ndev']) == [4, 4] and list(r['member_size']) == [4, 4] for r in ranks)
    uids = [uid.tobytes() for r in ranks for uid in r['uid']]
    assert len(uids[0]) == 128 and len(set(uids)) == 1


class ThreadLink:
    """The MpiLink calls nccl_across_processes makes, between threads standing for
    processes, so that one fake NCCL communicator can join them in this process."""

    def __init__(self, board, rank, size):
        self.board, self.rank, self.size = board, rank, size

    def _exchange(self, value):
        self.board['values'][self.rank] = value
        self.board['barrier'].wait()
        values = list(self.board['values'])
        self.board['barrier'].wait()
        return values

    def allgather(self, value):
        return self._exchange(value)

    def bcast_bytes(self, payload, root=0):
        return self._exchange(payload)[root]

    def allgather_bytes(self, payload):
        return self._exchange(payload)


def test_nccl_across_processes_sums_over_all_their_gpus():
    """Two "processes" (threads) of 2 GPUs each, through the fake NCCL and host streams:
    an allreduce sums the 4 buffers and a broadcast copies global rank 3's."""
    from helpers import fake_nccl

    from caffe_syncbn.comm.mpi import nccl_across_processes
    board = {'values': [None, None], 'barrier': threading.Barrier(2)}
    members = [None, None]

    def join(process):
        members[process] = nccl_across_processes(ThreadLink(board, process, 2), [0, 1],
                                                 nccl=fake_nccl,
                                                 streams_for=lambda d: HostStreams())
    threads = [threading.Thread(target=join, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    watchdog.join(threads, 'the processes joining NCCL')
    comms = members[0] + members[1]
    results = [None] * 4

    def run(rank):
        array = np.full(5, 10.0 ** rank)
        comms[rank].allreduce(array, tag='x')
        copy = np.full(3, float(rank))
        comms[rank].broadcast(copy, root=3, tag='y')
        results[rank] = (array, copy)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    watchdog.join(threads, 'the collectives across processes')
    for array, copy in results:
        assert np.array_equal(array, np.full(5, 1111.0)) and np.array_equal(copy, np.full(3, 3.0))


def test_nccl_across_processes_compares_each_call_first_and_names_both():
    """Two "processes" of one GPU each: one issues allreduce 'bn1', the other 'bn2' of the
    same shape, which NCCL would sum without a word. The records the processes exchange
    first (rendezvous.compare_across) fail both, naming both calls."""
    from helpers import fake_nccl

    from caffe_syncbn.comm import CollectiveMismatch
    from caffe_syncbn.comm.mpi import nccl_across_processes
    board = {'values': [None, None], 'barrier': threading.Barrier(2)}
    comms, errors = [None, None], [None, None]

    def run(process):
        comms[process] = nccl_across_processes(ThreadLink(board, process, 2), [process],
                                               nccl=fake_nccl,
                                               streams_for=lambda d: HostStreams())[0]
        comms[process].iteration = 7
        try:
            comms[process].allreduce(np.ones(3), tag='bn%d' % (process + 1))
        except CollectiveMismatch as exc:
            errors[process] = str(exc)
    threads = [threading.Thread(target=run, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    watchdog.join(threads, 'the processes')
    for error in errors:
        assert error is not None and error.startswith(
            "processes issued different collectives at the same point (process 0 called "
            "allreduce 'bn1' (float64, shape (3,)) at iteration 7; process 1 called allreduce "
            "'bn2' (float64, shape (3,)) at iteration 7)"), error


# ---- asynchronous updates across processes -------------------------------------------------------
def test_asynchronous_updates_across_processes_go_through_process_0(job):
    """12 iterations of 4 replicas (replica 1 slowed) are 48 updates at process 0's holder;
    the bound of 1 keeps every replica within 2 updates of the slowest."""
    holder = load(job / 'async-rank0.npz')
    assert int(holder['iter']) == 12 and int(holder['version']) == 48
    assert int(holder['spread']) <= 2 and sum(holder['clocks']) >= 48
    assert len(holder['staleness']) == 48


# ---- faults --------------------------------------------------------------------------------------
def fault_run(tmp_path, fault, where, rank, at=3, env=None, processes=2, max_iter=4,
              limit=120):
    """The job of ``fault`` (mpi_job.py), which must end as it would within ``limit``
    seconds on an idle machine."""
    from test_train_net import make_job
    solver = make_job(tmp_path / 'job', 2, max_iter=max_iter)
    result = launch(tmp_path, 'fault', solver, processes=processes, limit=limit,
                    env=dict({'FAULT': fault, 'FAULT_WHERE': where,
                              'FAULT_RANK': str(rank), 'FAULT_AT': str(at)}, **(env or {})))
    return result, tmp_path / 'job'


@needs_mpi
def test_a_raising_rank_ends_the_job_with_the_original_error(tmp_path):
    result, _ = fault_run(tmp_path, 'raise', 'forward', rank=1, limit=30)
    assert result.returncode != 0
    assert '[rank 1]' in result.stderr and 'ValueError: injected fault on rank 1' in result.stderr


@needs_mpi
@pytest.mark.parametrize('at', [3, 4])
def test_a_raising_replica_ends_an_asynchronous_job_while_the_others_go_on(tmp_path, at):
    """Under -async, one replica of process 1 raises while its neighbour keeps training
    (its updates need nobody else): the job still ends at once with that error. The 3rd
    and 4th forward-backward of process 1 belong to different replicas, mostly."""
    result, _ = fault_run(tmp_path, 'raise', 'forward', rank=1, at=at, max_iter=100000,
                          env={'FAULT_MODE': 'async'}, limit=15)   # not 100000 iterations
    assert result.returncode != 0
    assert '[rank 1]' in result.stderr and 'ValueError: injected fault on rank 1' in result.stderr


@needs_mpi
def test_an_uncaught_error_in_a_python_script_ends_the_job(tmp_path):
    """The Python API under mpiexec: the traceback, then MPI_Abort (not a hang)."""
    result = launch(tmp_path, 'uncaught', limit=30)
    assert result.returncode != 0
    assert 'ValueError: uncaught on rank 1' in result.stderr


@needs_mpi
@pytest.mark.parametrize('where, rank', [('forward', 1), ('reader', 1), ('snapshot', 0)])
def test_a_killed_rank_ends_the_job(tmp_path, where, rank):
    """SIGKILL in a collective, in the input pipeline, halfway through a snapshot: the job
    ends (as within 60 s on an idle machine), and no snapshot file is half written."""
    result, folder = fault_run(tmp_path, 'kill', where, rank, at=1 if where == 'snapshot' else 3,
                               limit=60)
    assert result.returncode != 0
    assert 'Killed' in result.stdout + result.stderr
    if where == 'snapshot':
        assert (folder / 'snap_iter_4.caffemodel').exists()
        assert not (folder / 'snap_iter_4.solverstate').exists()


@needs_mpi
def test_a_stopped_rank_is_found_by_the_heartbeats(tmp_path):
    """A rank frozen in a collective (SIGSTOP: the launcher sees nothing wrong) stops
    sending heartbeats; the other ends the job with a message naming it."""
    result, _ = fault_run(tmp_path, 'stop', 'forward', rank=1,
                          env={'CAFFE_SYNCBN_PEER_TIMEOUT': '4'}, limit=60)
    assert result.returncode != 0
    assert 'process(es) 1 sent no heartbeat for 4 s' in result.stderr
    assert '[rank 0] error:' in result.stderr


def test_process_0_alone_probes_the_snapshot_prefix_and_its_verdict_holds_for_all(job):
    """Every process probing, one could remove another's probe; so process 0 alone makes
    one (a name of its own) and broadcasts what it found."""
    ranks = [load(job / ('prefix-rank%d.npz' % r)) for r in range(2)]
    assert [int(rank['probes']) for rank in ranks] == [1, 0]
    holder = int(ranks[0]['pid'])        # process 0 alone takes the prefix's lock file
    assert [str(rank['lock']).split()[0] for rank in ranks] == [str(holder)] * 2
    errors = [str(rank['error']) for rank in ranks]
    assert errors[0] == errors[1] and 'planted: no room at' in errors[0], errors


@needs_mpi
def test_jobs_sharing_a_snapshot_prefix_all_start(tmp_path):
    """Jobs of 2 processes started at once with one snapshot prefix: only process 0 probes
    the prefix, with a name of its own, so no job fails its check (it once did in 7 of 20);
    the prefix's lock lets one job at a time train, and refuses the others in one line.
    STRESS_JOBS=20 runs the issue's 20 jobs; CI runs 4."""
    from test_train_net import make_job
    solver = make_job(tmp_path / 'job', 2, max_iter=1)
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    logs = [tmp_path / ('job%d.log' % k) for k in range(int(os.environ.get('STRESS_JOBS', 4)))]
    jobs = []
    for log in logs:
        with open(log, 'w') as stderr:
            jobs.append(subprocess.Popen([MPIEXEC, '-n', '2', sys.executable, '-m', 'caffe_syncbn',
                                          'train', '-solver', str(solver)], env=environment,
                                         stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path))
    for job in jobs:
        watchdog.wait(job, limit=600)
    errors = [log.read_text() for log in logs]
    # the prefix lock lets one job at a time write there; the others stop in one line
    failures = [error for job, error in zip(jobs, errors)
                if job.returncode != 0 and 'is in use by process' not in error]
    assert not failures and any(job.returncode == 0 for job in jobs), failures[:1]
