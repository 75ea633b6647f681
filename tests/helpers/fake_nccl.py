"""A stand-in for ``cupy.cuda.nccl`` over numpy buffers, for testing NcclComm without a GPU.

Ranks are threads. A collective blocks its caller until every rank of the communicator
has called it (real NCCL only enqueues, and its kernel waits on the GPU), then sums or
copies the buffers, read through their addresses, in rank order. ``abort()`` breaks the
wait of every rank, as ncclCommAbort ends the kernels waiting on a dead peer.
"""
import ctypes
import threading

import numpy as np

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = range(6)
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8
NCCL_SUM = 0
available = True
_DTYPES = {NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_INT64: np.int64,
           NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}
_groups = {}
_lock = threading.Lock()
calls = []                    # (rank, op, count) of every collective, for the tests
group_depth = threading.local()


class NcclError(RuntimeError):
    pass


UNIQUE_ID_BYTES = 128


def get_unique_id():
    """128 random bytes, as CuPy 14 returns them."""
    return np.random.bytes(UNIQUE_ID_BYTES)


def groupStart():
    group_depth.value = getattr(group_depth, 'value', 0) + 1


def groupEnd():
    group_depth.value -= 1


def _view(pointer, count, code):
    dtype = np.dtype(_DTYPES[code])
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(pointer)
    return np.frombuffer(raw, dtype)


class _Clique:
    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.deposits = [None] * size


class NcclCommunicator:
    def __init__(self, ndev, commId, rank):
        if not isinstance(commId, bytes) or len(commId) != UNIQUE_ID_BYTES:
            raise TypeError('commId must be the %d bytes of get_unique_id(), got %s'
                            % (UNIQUE_ID_BYTES, type(commId).__name__))
        with _lock:
            clique = _groups.setdefault(commId, _Clique(ndev))
        self._clique, self._rank, self._aborted = clique, rank, False

    @staticmethod
    def initAll(devices):
        uid = get_unique_id()
        return [NcclCommunicator(len(devices), uid, r) for r in range(len(devices))]

    def rank_id(self):
        return self._rank

    def size(self):
        return self._clique.size

    def abort(self):
        self._aborted = True
        self._clique.barrier.abort()

    def destroy(self):
        pass

    def _exchange(self, view):
        clique = self._clique
        if self._aborted:
            raise NcclError('NCCL_ERROR_INVALID_ARGUMENT: communicator aborted')
        try:
            clique.deposits[self._rank] = view
            clique.barrier.wait()
            inputs = [d.copy() for d in clique.deposits]
            clique.barrier.wait()        # every rank has read before any rank writes
            return inputs
        except threading.BrokenBarrierError:
            raise NcclError('NCCL_ERROR_SYSTEM_ERROR: a peer aborted') from None

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        assert op == NCCL_SUM
        calls.append((self._rank, 'allReduce', count))
        inputs = self._exchange(_view(sendbuf, count, datatype))
        total = inputs[0]
        for other in inputs[1:]:
            total = total + other
        _view(recvbuf, count, datatype)[...] = total

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        calls.append((self._rank, 'broadcast', count))
        inputs = self._exchange(_view(sendbuff, count, datatype))
        _view(recvbuff, count, datatype)[...] = inputs[root]
