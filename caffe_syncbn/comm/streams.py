"""Stream backends of the device communicators (same_device.py, nccl.py).

A backend does what a communicator needs from a device: the calling thread's current
stream, events recorded on a stream and waited on by another, the rank-ordered sum of
buffers and a copy (cuda/reduce.cu), buffers and pointers.

``CupyStreams`` does it with CuPy on one GPU. The tests' HostStreams (tests/host_streams.py)
is its CPU stand-in over numpy arrays, which can run the queued operations in any order a
GPU could.
"""

from ..backend import cuda_kernels
from ..backend.launch import BLOCK, grid_1d, i32, i64, vector_width

REDUCE_FAN_IN = 8          # buffers summed per launch of reduce_sum8


class CupyStreams:
    """Stream operations with CuPy on one device."""

    def __init__(self, device=0):
        import cupy
        self.cupy = cupy
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


def launch_sum(out, arrays):
    """Enqueue ``out = ((a0 + a1) + a2) + ...`` (flat, contiguous) on the current stream:
    reduce_sum8 launches of up to 8 buffers, each after the first adding onto ``out``."""
    n = out.size
    fn = cuda_kernels.typed_kernel('reduce', 'reduce_sum8', out.dtype)
    for start in range(0, len(arrays), REDUCE_FAN_IN):
        chunk = [a.reshape(-1) for a in arrays[start:start + REDUCE_FAN_IN]]
        unused = [out] * (REDUCE_FAN_IN - len(chunk))       # ignored by the kernel
        fn(grid_1d(-(-n // vector_width(out.dtype))), (BLOCK,),
           tuple(chunk + unused) + (i32(len(chunk)), i32(start > 0), out, i64(n)))


def launch_copy(dst, src):
    """Enqueue ``dst[:] = src`` (flat, contiguous, same dtype) on the current stream."""
    n = dst.size
    fn = cuda_kernels.typed_kernel('reduce', 'reduce_copy', dst.dtype)
    fn(grid_1d(-(-n // vector_width(dst.dtype))), (BLOCK,), (src, dst, i64(n)))
