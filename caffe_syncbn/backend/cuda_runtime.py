"""The CUDA runtime of the 'gpu' devices (device.py), through CuPy.

CuPy is imported when a GPU is first asked for, so the CPU package never needs it.
``CupyStreams`` is what the device communicators need of a GPU (comm/same_device.py,
comm/nccl.py): the calling thread's current stream, events recorded on one stream and
waited on by another, the rank-ordered sum of buffers and a copy (cuda/comm_sum.cu),
buffers and pointers. The tests' HostStreams (tests/helpers/host_streams.py) is its CPU stand-in.
"""
from . import cuda_kernels
from .launch import BLOCK, grid_1d, i32, i64, vector_width

REDUCE_FAN_IN = 8          # buffers summed per launch of reduce_sum8


def _cupy():
    import cupy
    return cupy


class CudaRuntime:
    """GPUs through CuPy (see device.py for what a runtime answers)."""

    def array_module(self):
        return _cupy()

    def owns(self, array):
        return type(array).__module__.startswith('cupy')

    def to_host(self, array):
        return array.get()

    def count(self):
        """How many CUDA devices CuPy sees (0 without CuPy, a driver or a device)."""
        try:
            return _cupy().cuda.runtime.getDeviceCount()
        except Exception:       # ImportError and CuPy's own errors all mean "no GPU here"
            return 0

    def name(self, index):
        name = _cupy().cuda.runtime.getDeviceProperties(index)['name']
        return name.decode() if isinstance(name, bytes) else str(name)

    def activate(self, index):
        cupy = _cupy()
        cupy.cuda.Device(index).use()
        cupy.cuda.Stream(non_blocking=True).use()

    def select(self, index):
        _cupy().cuda.Device(index).use()

    def current_index(self):
        return _cupy().cuda.Device().id

    def synchronize(self, index):
        cupy = _cupy()
        with cupy.cuda.Device(index):
            cupy.cuda.get_current_stream().synchronize()

    def streams(self, index):
        return CupyStreams(index)

    def nccl(self):
        from cupy.cuda import nccl
        if not getattr(nccl, 'available', True):
            raise RuntimeError('CuPy was built without NCCL: install a cupy-cuda13x wheel with '
                               'NCCL')
        return nccl


class CupyStreams:
    """Stream operations with CuPy on one device."""

    def __init__(self, device=0):
        self.cupy = _cupy()
        self.device = int(device)

    def is_device_array(self, array):
        return isinstance(array, self.cupy.ndarray)

    def current_stream(self):
        return self.cupy.cuda.get_current_stream()

    def record_event(self, stream):
        with self.cupy.cuda.Device(self.device):
            event = self.cupy.cuda.Event(block=False, disable_timing=True)
            event.record(stream)
        return event

    def wait_event(self, stream, event):
        with self.cupy.cuda.Device(self.device):
            stream.wait_event(event)

    def new_stream(self):
        with self.cupy.cuda.Device(self.device):
            return self.cupy.cuda.Stream(non_blocking=True)

    def handle(self, stream):
        """What NCCL takes as the stream argument."""
        return stream.ptr

    def pointer(self, array):
        return array.data.ptr

    def event_done(self, event):
        return event.done

    def wait_host(self, event):
        event.synchronize()

    def to_device(self, array):
        with self.cupy.cuda.Device(self.device):
            return self.cupy.asarray(array)

    def to_host(self, array, out):
        with self.cupy.cuda.Device(self.device):
            out[...] = array.get(stream=self.current_stream())

    def empty(self, size, dtype, stream):
        # allocated on `stream` (member 0's), so CuPy's per-stream pool reuses the memory
        # only in that stream's order
        with self.cupy.cuda.Device(self.device), stream:
            return self.cupy.empty(size, dtype)

    def sum_into(self, out, arrays, stream):
        with self.cupy.cuda.Device(self.device), stream:
            launch_sum(out, arrays)

    def copy(self, dst, src, stream):
        with self.cupy.cuda.Device(self.device), stream:
            launch_copy(dst, src)

    def device_scope(self):
        """The device current inside a ``with``, for NCCL calls."""
        return self.cupy.cuda.Device(self.device)


def launch_sum(out, arrays):
    """Enqueue ``out = ((a0 + a1) + a2) + ...`` (flat, contiguous) on the current stream:
    reduce_sum8 launches of up to 8 buffers, each after the first adding onto ``out``."""
    n = out.size
    fn = cuda_kernels.typed_kernel('comm_sum', 'reduce_sum8', out.dtype)
    for start in range(0, len(arrays), REDUCE_FAN_IN):
        chunk = [a.reshape(-1) for a in arrays[start:start + REDUCE_FAN_IN]]
        unused = [out] * (REDUCE_FAN_IN - len(chunk))       # ignored by the kernel
        fn(grid_1d(-(-n // vector_width(out.dtype))), (BLOCK,),
           tuple(chunk + unused) + (i32(len(chunk)), i32(start > 0), out, i64(n)))


def launch_copy(dst, src):
    """Enqueue ``dst[:] = src`` (flat, contiguous, same dtype) on the current stream."""
    n = dst.size
    fn = cuda_kernels.typed_kernel('comm_sum', 'reduce_copy', dst.dtype)
    fn(grid_1d(-(-n // vector_width(dst.dtype))), (BLOCK,), (src, dst, i64(n)))
