"""One replica needs no communicator: SoloComm, on any device, without NCCL."""
import numpy as np
import pytest

from caffe_syncbn.comm import CommAborted, SoloComm
from caffe_syncbn.comm import communicators


class DeviceArray:
    """An array SoloComm must not look into (as a CuPy array on a machine without CUDA)."""


def test_one_device_of_any_kind_gets_a_solo_comm(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_gpu_libraries(name, *args, **kwargs):
        if name.startswith('cupy') or name.endswith('nccl'):
            raise ImportError('no %s here' % name)
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, '__import__', no_gpu_libraries)
    for device in (('gpu', 0), ('gpu', 3), ('cpu', 0)):
        comms = communicators([device])
        assert len(comms) == 1 and isinstance(comms[0], SoloComm)


def test_collectives_are_the_identity_until_aborted():
    comm, = SoloComm.create()
    array, opaque = np.arange(4.0), DeviceArray()
    assert comm.allreduce(array, tag='bn1') is array and array.tolist() == [0, 1, 2, 3]
    assert comm.broadcast(opaque) is opaque and comm.allreduce(opaque) is opaque
    assert comm.allreduce_async(opaque).wait() is opaque
    assert comm.allreduce_scalar(2.5) == 2.5
    comm.barrier()
    with pytest.raises(ValueError):
        comm.broadcast(array, root=1)
    cause = RuntimeError('replica 0 failed')
    comm.abort(cause)
    with pytest.raises(CommAborted) as info:
        comm.allreduce(array)
    assert info.value.__cause__ is cause
