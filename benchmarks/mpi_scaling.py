#!/usr/bin/env python3
"""Across processes on the CPU: what the ordered reduction costs, and how placements compare.

    python benchmarks/mpi_scaling.py [--iterations 30] [--replicas 4]

It starts MPI jobs itself (the mpiexec beside this Python, as `pip install '.[mpi]'`
puts it there) and prints two tables:

* allreduce: ProcessGroupComm's allreduce (the call compared across the processes, then
  the partial sum passed along them in rank order and broadcast: bitwise the sum of one
  process) against MPI's own Allreduce (which may regroup the sum), 2 processes of 1
  replica, for a SyncBN layer's buffer (1 + 2 x 64 float64), 64 KiB, 1 MiB and a 25 MiB
  gradient bucket; the median of repeated calls, the ratio, and what the comparison of
  the calls (rendezvous.compare_across: one allgather of a 256-byte record) takes alone;
* training: the demo net (examples/segmentation/fcn_bn.prototxt, SyncBN, 1 image per
  device) at the same global batch of ``--replicas`` images, as 1 process of R threads,
  2 processes of R/2 and R processes of 1, with SyncBN over all replicas and in groups
  (-sync_bn_group_size) within each process: median seconds per iteration, images/s as
  a ratio to the 1-process run, the bytes of SyncBN's sums that reach a process from
  another per iteration (all processes together; 0 where every group lies within a
  process, as it lies within a node when each node runs one process), and how many calls
  process 0 compares with other processes per iteration.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'examples', 'segmentation'))

import numpy as np  # noqa: E402

SIZES = [('SyncBN layer, C=64', 129), ('64 KiB', 8192), ('1 MiB', 131072),
         ('25 MiB bucket', 25 << 17)]


def median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def allreduce_worker():
    """Under mpiexec -n 2: the two reductions, one replica per process."""
    from mpi4py import MPI

    from caffe_syncbn.comm.mpi import ProcessGroupComm, job_link
    from caffe_syncbn.comm.rendezvous import Call, compare_across
    link = job_link()
    comm = ProcessGroupComm.create(link, 1)[0]
    rows = []
    for name, size in SIZES:
        array = np.ones(size)
        repeats = 50 if size < 1 << 20 else 10

        def ordered():
            comm.allreduce(array, 'x')

        def builtin():
            link.comm.Allreduce(MPI.IN_PLACE, array)

        def check():
            compare_across(link, Call('allreduce', 'x', array))
        link.barrier()
        chain = median_seconds(ordered, repeats)
        link.barrier()
        mpi = median_seconds(builtin, repeats)
        link.barrier()
        compared = median_seconds(check, repeats)
        rows.append((name, size * 8, chain, mpi, compared))
    if link.rank == 0:
        print(json.dumps(rows))
    link.close()


def count_traffic(names):
    """Count the bytes that reach this process from another over MPI for a collective
    tagged with one of ``names`` (the SyncBN layers): what it receives in the chain and
    in broadcasts from another process; and the calls it compares with other processes
    (rendezvous.compare_across). Returns the running counts."""
    from caffe_syncbn.comm.mpi import Channel
    counted = {'bytes': 0, 'compared': 0}

    def comparing(self, payload, _original=Channel.allgather_bytes):
        counted['compared'] += 1
        return _original(self, payload)
    Channel.allgather_bytes = comparing
    tags = {repr(name) for name in names}
    for method in ('recv', 'bcast'):
        def counting(self, array, peer, what, _original=getattr(Channel, method),
                     _received=method == 'recv'):
            if what.split(' ', 1)[-1] in tags and (_received or peer != self.rank):
                counted['bytes'] += array.nbytes
            return _original(self, array, peer, what)
        setattr(Channel, method, counting)
    return counted


def training_worker(iterations, devices, out, group_size):
    import logging

    import compare
    from make_dataset import make_dataset

    from caffe_syncbn.comm.mpi import job_link
    from caffe_syncbn.training.solvers import get_solver
    logging.getLogger('caffe_syncbn').setLevel(logging.WARNING)
    link = job_link()
    data = os.path.join(out, 'data')
    if link is None or link.rank == 0:
        if not os.path.isdir(data):
            make_dataset(data, train=200, val=16)
        compare.write_net_and_solver(out, data, 1, {'max_iter': iterations, 'test_interval': 10 ** 6,
                                                    'display': 0, 'snapshot_after_train': False})
    if link is not None:
        link.barrier()
    solver = get_solver(os.path.join(out, 'solver.prototxt'), devices='cpu:%d' % devices,
                        sync_bn=True, sync_bn_group_size=group_size or None)
    counted = count_traffic([layer.name for layer in solver.net.layers
                             if layer.type == 'SyncBN'])
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        solver.forward_backward_all()
        solver.apply_update()
        solver.iter += 1
        times.append(time.perf_counter() - start)
    solver.close()
    syncbn_bytes = sum(link.allgather(counted['bytes'])) if link is not None else 0
    if link is None or link.rank == 0:
        print(json.dumps([sorted(times[3:])[len(times[3:]) // 2], syncbn_bytes / iterations,
                          counted['compared'] / iterations]))
    if link is not None:
        link.close()


def run(command):
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    if result.returncode:
        raise SystemExit('%s failed:\n%s' % (' '.join(command), result.stderr[-2000:]))
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--iterations', type=int, default=30)
    parser.add_argument('--replicas', type=int, default=4)
    parser.add_argument('--out', default=os.path.join(ROOT, 'out', 'mpi_scaling'))
    parser.add_argument('--worker', choices=['allreduce', 'training'])
    parser.add_argument('--devices', type=int, default=1)
    parser.add_argument('--group-size', type=int, default=0)
    args = parser.parse_args()
    if args.worker == 'allreduce':
        return allreduce_worker()
    if args.worker == 'training':
        return training_worker(args.iterations, args.devices, args.out, args.group_size)
    mpiexec = shutil.which('mpiexec', path=os.path.dirname(sys.executable) + os.pathsep +
                           os.environ.get('PATH', ''))
    if mpiexec is None:
        raise SystemExit("mpiexec not found: pip install '.[mpi]'")
    me = [sys.executable, os.path.abspath(__file__)]
    print('allreduce, 2 processes x 1 replica: ordered (bitwise the sum of one process, the '
          'calls compared first) against MPI_Allreduce')
    print('%-20s %10s %12s %12s %8s %14s' % ('buffer', 'bytes', 'ordered', 'MPI', 'ratio',
                                             'of which check'))
    for name, size, chain, mpi, check in run([mpiexec, '-n', '2'] + me +
                                             ['--worker', 'allreduce']):
        print('%-20s %10d %9.3f ms %9.3f ms %7.2fx %11.3f ms' % (
            name, size, chain * 1e3, mpi * 1e3, chain / mpi, check * 1e3))
    r = args.replicas
    placements = [(1, r, 0), (2, r // 2, 0), (2, r // 2, r // 2), (r, 1, 0), (r, 1, 2)]
    print()
    print('training fcn_bn with SyncBN, global batch %d images, median of %d iterations'
          % (r, args.iterations - 3))
    print('%-22s %-14s %12s %10s %10s %16s %11s' % (
        'placement', 'SyncBN over', 's/iteration', 'images/s', 'vs 1 proc', 'SyncBN MPI B/it',
        'compared/it'))
    reference = None
    for processes, devices, group in placements:
        worker = me + ['--worker', 'training', '--devices', str(devices), '--iterations',
                       str(args.iterations), '--out', args.out, '--group-size', str(group)]
        seconds, syncbn_bytes, compared = run(worker if processes == 1 else
                                              [mpiexec, '-n', str(processes)] + worker)
        reference = reference or seconds
        print('%-22s %-14s %12.3f %10.1f %9.2fx %16.0f %11.1f' % (
            '%d process(es) x %d' % (processes, devices),
            'groups of %d' % group if group else 'all %d' % r, seconds, r / seconds,
            reference / seconds, syncbn_bytes, compared))


if __name__ == '__main__':
    main()
