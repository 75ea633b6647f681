"""SameDeviceComm, the communicator of replicas sharing one GPU, on its CPU stand-in.

HostStreams(deferred=True) queues every stream operation and runs them afterwards in a
random interleaving that keeps each stream's order and honours event waits, as a GPU
may: a missing wait in the communicator shows up as a wrong sum for some seed. The
kernels of the GPU backend (cuda/comm_sum.cu) run here through the CPU emulation.
"""

import numpy as np
import pytest
from helpers.host_streams import HostStreams
from helpers.threads import run_threads

from caffe_syncbn.comm import CollectiveMismatch, CommAborted
from caffe_syncbn.comm.same_device import SameDeviceComm
from caffe_syncbn.backend.cuda_runtime import launch_copy, launch_sum

run_members = run_threads


def ok(results_errors):
    results, errors = results_errors
    for e in errors:
        if e is not None:
            raise e
    return results


def rank_order_sum(arrays):
    total = arrays[0].copy()
    for a in arrays[1:]:
        total += a
    return total


def member_values(rank, shape, dtype, round_=0):
    rs = np.random.RandomState(100 * round_ + rank)
    # magnitudes far apart make the float sum depend on the order of the additions
    return (rs.standard_normal(shape) * 10.0 ** (3 * (rank % 3) - 3)).astype(dtype)


@pytest.mark.parametrize('size', [1, 2, 4, 9])
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_allreduce_sums_in_rank_order_bitwise_equal_everywhere(size, dtype):
    comms = SameDeviceComm.create(size, streams=HostStreams())
    shape = (3, 5)

    def member(rank):
        a = member_values(rank, shape, dtype)
        comms[rank].allreduce(a, tag='x')
        return a

    results = ok(run_members(member, size))
    want = rank_order_sum([member_values(r, shape, dtype) for r in range(size)])
    for a in results:
        np.testing.assert_array_equal(a, want)


@pytest.mark.parametrize('seed', range(6))
def test_stream_order_holds_in_any_legal_interleaving(seed):
    """Deferred streams: producer writes, allreduce, consumer reads, for several rounds that
    reuse the buffers and the group's scratch; then a random legal GPU schedule."""
    size, rounds, shape = 4, 3, (7,)
    streams = HostStreams(deferred=True)
    comms = SameDeviceComm.create(size, streams=streams)
    seen = [[None] * rounds for _ in range(size)]

    def member(rank):
        streams.use(streams.stream('replica%d' % rank))
        buffer = np.zeros(shape)
        for k in range(rounds):
            values = member_values(rank, shape, np.float64, k)
            streams.launch(lambda v=values: buffer.__setitem__(Ellipsis, v), 'produce')
            comms[rank].allreduce(buffer, tag='round %d' % k)
            streams.launch(lambda k=k: seen[rank].__setitem__(k, buffer.copy()), 'consume')
        root_data = np.full(shape, float(rank))
        streams.launch(lambda: None, 'produce')
        comms[rank].broadcast(root_data, root=2, tag='bcast')
        streams.launch(lambda: seen[rank].append(root_data.copy()), 'consume')
        streams.launch(lambda: root_data.__setitem__(Ellipsis, -1.0), 'overwrite')

    ok(run_members(member, size))
    streams.run(seed)
    for k in range(rounds):
        want = rank_order_sum([member_values(r, shape, np.float64, k) for r in range(size)])
        for rank in range(size):
            np.testing.assert_array_equal(seen[rank][k], want)
    for rank in range(size):
        np.testing.assert_array_equal(seen[rank][rounds], 2.0)
    sums = [stream for stream, op in streams.log if op == 'sum']
    assert sums == ['replica0'] * rounds, 'the sum runs on member 0\'s stream, once per allreduce'


@pytest.mark.parametrize('seed', range(6))
def test_async_allreduces_in_flight_together_in_any_legal_interleaving(seed):
    """Several async allreduces submitted before any wait (gradient buckets): the scratch
    must not be reused before every member has copied the previous sum out."""
    size, buckets, shape = 3, 4, (5,)
    streams = HostStreams(deferred=True)
    comms = SameDeviceComm.create(size, streams=streams)
    seen = [[None] * buckets for _ in range(size)]

    def member(rank):
        streams.use(streams.stream('replica%d' % rank))
        arrays = [np.zeros(shape) for _ in range(buckets)]
        handles = []
        for k in range(buckets):
            values = member_values(rank, shape, np.float64, k)
            streams.launch(lambda a=arrays[k], v=values: a.__setitem__(Ellipsis, v), 'produce')
            handles.append(comms[rank].allreduce_async(arrays[k], tag='bucket %d' % k))
        for k, handle in enumerate(handles):
            handle.wait(10)
            streams.launch(lambda k=k: seen[rank].__setitem__(k, arrays[k].copy()), 'consume')
        comms[rank].close()

    ok(run_members(member, size))
    streams.run(seed)
    for k in range(buckets):
        want = rank_order_sum([member_values(r, shape, np.float64, k) for r in range(size)])
        for rank in range(size):
            np.testing.assert_array_equal(seen[rank][k], want)


def test_broadcast_copies_the_root_and_leaves_it_unchanged():
    comms = SameDeviceComm.create(3, streams=HostStreams())

    def member(rank):
        a = np.full((2, 2), rank, np.float32)
        comms[rank].broadcast(a, root=1)
        return a

    for a in ok(run_members(member, 3)):
        np.testing.assert_array_equal(a, 1)


def test_async_allreduce_scalar_barrier_and_host_arrays():
    comms = SameDeviceComm.create(3, streams=HostStreams())

    def member(rank):
        a = np.full(4, rank + 1.0)
        handle = comms[rank].allreduce_async(a, tag='grads')
        total = comms[rank].allreduce_scalar(rank + 0.5, tag='count')   # after the async one
        result = handle.wait(10)
        comms[rank].barrier()
        comms[rank].close()
        return result.copy(), total

    for result, total in ok(run_members(member, 3)):
        np.testing.assert_array_equal(result, 6.0)
        assert total == 4.5


def test_a_failing_member_releases_the_others_promptly():
    comms = SameDeviceComm.create(4, streams=HostStreams(), timeout=60)

    def member(rank):
        a = np.ones(3)
        comms[rank].allreduce(a, tag='step 1')
        if rank == 2:
            comms[rank].abort(RuntimeError('replica 2 failed'))
            raise RuntimeError('replica 2 failed')
        comms[rank].allreduce(a, tag='step 2')

    _, errors = run_members(member, 4)     # members left waiting out the 60 s: a hang
    assert isinstance(errors[2], RuntimeError)
    for rank in (0, 1, 3):
        assert isinstance(errors[rank], CommAborted), errors[rank]
        assert 'replica 2 failed' in str(errors[rank])


def test_a_member_that_never_comes_times_out():
    comms = SameDeviceComm.create(2, streams=HostStreams(), timeout=0.5)

    def member(rank):
        if rank == 0:
            comms[0].allreduce(np.ones(2), tag='lonely')

    _, errors = run_members(member, 2)
    assert isinstance(errors[0], CommAborted) and 'timed out' in str(errors[0])


def test_mismatched_collectives_raise_on_every_member():
    comms = SameDeviceComm.create(2, streams=HostStreams())

    def member(rank):
        comms[rank].allreduce(np.ones(2), tag='bn%d' % rank)

    _, errors = run_members(member, 2)
    for e in errors:
        assert isinstance(e, CollectiveMismatch) and 'bn0' in str(e) and 'bn1' in str(e)


@pytest.mark.parametrize('count', [1, 3, 8, 11, 17])
@pytest.mark.parametrize('dtype,n', [(np.float32, 37), (np.float32, 64), (np.float64, 10),
                                     (np.float16, 24)])
def test_reduce_kernels_sum_in_rank_order(monkeypatch, count, dtype, n):
    """cuda/comm_sum.cu through the CPU emulation: chained launches of 8 keep the rank order."""
    from helpers.cuda_emulation import emulated_kernels
    emulated_kernels(monkeypatch)
    arrays = [member_values(r, (n,), np.float32).astype(dtype) for r in range(count)]
    out = np.empty(n, dtype)
    launch_sum(out, arrays)
    if dtype == np.float16:          # summed in float32, rounded once per launch of 8
        want = np.zeros(n, dtype)
        for start in range(0, count, 8):
            acc = want.astype(np.float32) if start else arrays[0].astype(np.float32)
            for a in arrays[start + (0 if start else 1):start + 8]:
                acc += a.astype(np.float32)
            want = acc.astype(np.float16)
    else:
        want = rank_order_sum(arrays)
    np.testing.assert_array_equal(out, want)
    copied = np.zeros(n, dtype)
    launch_copy(copied, out)
    np.testing.assert_array_equal(copied, out)
