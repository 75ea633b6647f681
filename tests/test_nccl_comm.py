"""NcclComm's logic on a stand-in of cupy.cuda.nccl (tests/helpers/fake_nccl.py) and the CPU
stand-in of the stream backend: dtype codes, counts, stream-ordered calls, the host
comparison of calls, group calls, abort. The real NCCL runs in tests/gpu/."""

from helpers import fake_nccl
import numpy as np
import pytest
from helpers.host_streams import HostStreams
from test_same_device_comm import ok, rank_order_sum, run_members

from caffe_syncbn.comm import CollectiveMismatch, CommAborted
from caffe_syncbn.comm.nccl import NcclComm


def create(n):
    return NcclComm.create_all(list(range(n)), timeout=30, nccl=fake_nccl,
                               streams_for=lambda device: HostStreams())


def test_duplicate_devices_point_to_same_device_comm():
    with pytest.raises(ValueError, match='SameDeviceComm'):
        NcclComm.create_all([0, 0], nccl=fake_nccl, streams_for=lambda d: HostStreams())


@pytest.mark.parametrize('dtype', [np.float16, np.float32, np.float64])
def test_collectives(dtype):
    comms = create(3)

    def member(rank):
        comm = comms[rank]
        a = (np.arange(6, dtype=np.float64) * 10.0 ** rank).astype(dtype).reshape(2, 3)
        comm.allreduce(a, tag='a')
        b = np.full(4, float(rank), dtype)
        comm.broadcast(b, root=2, tag='b')
        parts = [np.full(2, rank + 1.0, dtype), np.full(3, 2.0 * rank, dtype)]
        comm.allreduce_many(parts, tag='bucket')
        handle = comm.allreduce_async(np.ones(5, dtype), tag='async')
        total = comm.allreduce_scalar(rank + 0.25, tag='count')
        comm.barrier()
        return a, b, parts, handle.wait(), total

    results = ok(run_members(member, 3))
    want_a = rank_order_sum([(np.arange(6, dtype=np.float64) * 10.0 ** r).astype(dtype)
                             for r in range(3)]).reshape(2, 3)
    for a, b, parts, c, total in results:
        np.testing.assert_array_equal(a, want_a)
        np.testing.assert_array_equal(b, 2)
        np.testing.assert_array_equal(parts[0], 6)
        np.testing.assert_array_equal(parts[1], 6)
        np.testing.assert_array_equal(c, 3)
        assert total == 3.75


def test_mismatched_calls_raise_before_reaching_nccl():
    comms = create(2)
    fake_nccl.calls.clear()

    def member(rank):
        comms[rank].allreduce(np.ones(3 + rank), tag='bn%d' % rank)

    _, errors = run_members(member, 2)
    for e in errors:
        assert isinstance(e, CollectiveMismatch) and 'bn0' in str(e) and 'bn1' in str(e)
    assert fake_nccl.calls == []


def test_abort_stops_every_member_and_the_nccl_communicators():
    comms = create(3)

    def member(rank):
        a = np.ones(2)
        comms[rank].allreduce(a, tag='step 1')
        if rank == 1:
            comms[rank].abort(RuntimeError('replica 1 failed'))
            raise RuntimeError('replica 1 failed')
        comms[rank].allreduce(a, tag='step 2')

    _, errors = run_members(member, 3)           # members left waiting: a hang
    for rank in (0, 2):
        assert isinstance(errors[rank], CommAborted) and 'replica 1 failed' in str(errors[rank])
    assert all(c._raw._aborted for c in comms)


def test_ranks_from_a_unique_id():
    uid = NcclComm.unique_id(nccl=fake_nccl)

    def member(rank):
        comm = NcclComm.from_unique_id(2, uid, rank, device=rank, nccl=fake_nccl,
                                       streams_for=lambda d: HostStreams())
        a = np.full(3, rank + 1.0, np.float32)
        comm.allreduce(a)
        comm.barrier()
        return a, comm.allreduce_scalar(2.0), comm.size, comm.rank

    results = ok(run_members(member, 2))
    for rank, (a, total, size, r) in enumerate(results):
        np.testing.assert_array_equal(a, 3)
        assert (total, size, r) == (4.0, 2, rank)
