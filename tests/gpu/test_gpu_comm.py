"""The GPU communicators on a real device: SameDeviceComm (several replicas, one GPU, one
stream each) and NcclComm with one rank."""
import numpy as np
import pytest

from gpu_support import require_gpu

cupy = require_gpu()
pytestmark = pytest.mark.gpu

from caffe_syncbn.comm.nccl import NcclComm  # noqa: E402
from caffe_syncbn.comm.same_device import SameDeviceComm  # noqa: E402
from test_same_device_comm import member_values, ok, rank_order_sum, run_members  # noqa: E402


@pytest.mark.parametrize('size', [1, 4, 9])
def test_same_device_allreduce_broadcast_async(size):
    comms = SameDeviceComm.create(size, device=0, timeout=60)
    shape = (257, 3)

    def member(rank):
        with cupy.cuda.Device(0), cupy.cuda.Stream(non_blocking=True) as stream:
            results = []
            for k in range(3):      # buffers and scratch reused
                a = cupy.asarray(member_values(rank, shape, np.float32, k))
                comms[rank].allreduce(a, tag='round %d' % k)
                a *= 1              # more work on the stream, ordered after the copy-out
                results.append(cupy.asnumpy(a))
            b = cupy.full(5, float(rank), np.float64)
            comms[rank].broadcast(b, root=size - 1)
            c = cupy.ones(7, np.float16)
            handle = comms[rank].allreduce_async(c, tag='async')
            total = comms[rank].allreduce_scalar(1.0)
            handle.wait()
            stream.synchronize()
            comms[rank].close()
            return results, cupy.asnumpy(b), cupy.asnumpy(c), total

    for results, b, c, total in ok(run_members(member, size, timeout=120)):
        for k in range(3):
            want = rank_order_sum([member_values(r, shape, np.float32, k) for r in range(size)])
            np.testing.assert_array_equal(results[k], want)
        np.testing.assert_array_equal(b, size - 1)
        np.testing.assert_array_equal(c, size)
        assert total == size


def test_nccl_one_rank():
    comm, = NcclComm.create_all([0])
    with cupy.cuda.Device(0), cupy.cuda.Stream(non_blocking=True) as stream:
        a = cupy.arange(10, dtype=np.float32)
        comm.allreduce(a, tag='a')
        parts = [cupy.ones(3, np.float64), cupy.full(4, 2.0, np.float32)]
        comm.allreduce_many(parts, tag='bucket')
        handle = comm.allreduce_async(cupy.ones(6, np.float16), tag='async')
        comm.broadcast(a, root=0)
        host = np.arange(4.0)
        comm.allreduce(host)
        done = handle.wait()
        comm.barrier()
        stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(a), np.arange(10))
    np.testing.assert_array_equal(cupy.asnumpy(parts[1]), 2)
    np.testing.assert_array_equal(cupy.asnumpy(done), 1)
    np.testing.assert_array_equal(host, np.arange(4.0))
    assert comm.allreduce_scalar(2.5) == 2.5
