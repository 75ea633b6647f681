"""Grid sizes and argument types shared by the kernel wrappers."""
import numpy as np

from . import cuda_kernels

BLOCK = 256
#: resident 256-thread blocks per SM that fill it (2048 threads)
BLOCKS_PER_SM = 8
#: grid-stride kernels stop growing their grid here (blocks per SM)
MAX_BLOCKS_PER_SM = 32


def vector_width(dtype):
    """Values per 16-byte load, as the kernels use them."""
    return 16 // np.dtype(dtype).itemsize


def grid_1d(work_items):
    """Blocks of BLOCK threads for a grid-stride loop over ``work_items``."""
    blocks = -(-int(work_items) // BLOCK)
    return (max(1, min(blocks, cuda_kernels.multiprocessor_count() * MAX_BLOCKS_PER_SM)),)


def grid_channels(count):
    """Blocks for one thread per channel (or per any small item)."""
    return (max(1, -(-int(count) // BLOCK)),)


def i32(v):
    return np.int32(v)


def i64(v):
    return np.int64(v)


def f64(v):
    return np.float64(v)


def contiguous(xp, a):
    return a if a.flags.c_contiguous else xp.ascontiguousarray(a)
