"""The kernel emulation (tests/helpers/cuda_host_emulation.h) is strict: small kernels that
break one CUDA rule each must fail with an error naming the kernel and line, or give the wrong
numbers that a GPU would, never pass by the emulation's leniency."""
import re

import numpy as np
import pytest

from helpers import cuda_emulation
from helpers.cuda_emulation import KernelError, schedule

#: block_sum of cuda/common.cuh without its first __syncthreads: warps drift apart and the
#: second call overwrites scratch that a slower warp still reads from the first
_BLOCK_SUM_RACE = r'''
#include "common.cuh"
template <class A> __device__ A racy_block_sum(A v, A* scratch) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int nwarps = (blockDim.x + 31) >> 5;
    v = lane < nwarps ? scratch[lane] : A(0);
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return __shfl_sync(0xffffffffu, v, 0);
}
// out[0] = sum(x), out[1] = sum(2x): two block sums in a row, as write_partials does
extern "C" __global__ void two_sums(const float* x, float* out) {
    __shared__ float scratch[32];
    const float v = x[threadIdx.x];
    const float a = racy_block_sum(v, scratch);
    const float b = racy_block_sum(2 * v, scratch);
    if (threadIdx.x == 0) { out[0] = a; out[1] = b; }
}
'''

_BAD_KERNELS = r'''
// half a warp shuffles with a full mask
extern "C" __global__ void half_warp_shuffle(float* out) {
    float v = threadIdx.x;
    if (threadIdx.x < 16) v = __shfl_down_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}
// a full mask in a 48-thread block: warp 1 has lanes 0..15 only
extern "C" __global__ void mask_past_block(float* out) {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);
}
// threads past the data return before the barrier the others wait at
extern "C" __global__ void early_exit_barrier(const float* x, float* out, int n) {
    if ((int)threadIdx.x >= n) return;
    __shared__ float tile[1024];
    tile[threadIdx.x] = x[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = tile[n - 1 - threadIdx.x];
}
// even and odd warps meet different barriers
extern "C" __global__ void split_barrier(float* out) {
    if ((threadIdx.x >> 5) & 1) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1;
}
// lane 0 shuffles at one line, the others at another
extern "C" __global__ void two_shuffle_sites(float* out) {
    float v = threadIdx.x;
    if ((threadIdx.x & 31) == 0) v = __shfl_sync(0xffffffffu, v, 1);
    else v = __shfl_sync(0xffffffffu, v, 0);
    out[threadIdx.x] = v;
}
// reads the shared tile before any thread wrote it
extern "C" __global__ void unwritten_shared(float* out) {
    __shared__ float tile[64];
    if (threadIdx.x < 32) tile[threadIdx.x] = 1;
    __syncthreads();
    out[threadIdx.x] = tile[threadIdx.x];
}
// warp w shuffles w+1 times between barriers: fine on a GPU, where each warp waits only for
// its own lanes; a block-wide shuffle would hang or mix the warps' values
extern "C" __global__ void warp_local_shuffles(float* out) {
    float v = threadIdx.x;
    const int warp = threadIdx.x >> 5;
    for (int k = 0; k <= warp; ++k) v = __shfl_xor_sync(0xffffffffu, v, 1);
    __syncthreads();
    out[threadIdx.x] = v;
}
// the lower 16 lanes shuffle among themselves: a partial mask is fine when it is exact
extern "C" __global__ void partial_mask_shuffle(float* out) {
    float v = threadIdx.x;
    if ((threadIdx.x & 31) < 16) v = __shfl_down_sync(0x0000ffffu, v, 8, 16);
    out[threadIdx.x] = v;
}
extern "C" __global__ void __launch_bounds__(128) bounded(float* out) { out[threadIdx.x] = 1; }
'''


@pytest.fixture
def custom(tmp_path, monkeypatch):
    """Build kernels from source text in a scratch cuda folder (common.cuh copied in)."""
    monkeypatch.setenv('CAFFE_SYNCBN_EMU_CUDA_DIR', str(tmp_path))
    (tmp_path / 'common.cuh').write_text((cuda_emulation.ROOT / 'cuda' / 'common.cuh').read_text())

    def build(stem, code, name):
        (tmp_path / (stem + '.cu')).write_text(code)
        return cuda_emulation.EmulatedKernel(stem, name)
    return build


def _line(code, text):
    return 1 + code.split(text)[0].count('\n')


@pytest.mark.parametrize('policy', ['forward', 'reverse', 'random:1'])
def test_block_sum_race_is_seen_in_some_order(custom, policy):
    """Without the barrier the second sum overwrites scratch early: the order that runs the
    reading warp last shows it (thread 0's warp: reverse), the others may not."""
    fn = custom('race', _BLOCK_SUM_RACE, 'two_sums')
    x = np.arange(1, 257, dtype=np.float32)
    out = np.zeros(2, np.float32)
    with schedule(policy):
        fn((1,), (256,), (x, out))
    if policy == 'reverse':
        assert out[0] != x.sum()
    assert out[1] == 2 * x.sum()


def test_block_sum_with_barrier_is_right_in_every_order(custom):
    code = _BLOCK_SUM_RACE.replace('    if (lane == 0) scratch[warp] = v;',
                                   '    __syncthreads();\n    if (lane == 0) scratch[warp] = v;')
    fn = custom('norace', code, 'two_sums')
    x = np.arange(1, 257, dtype=np.float32)
    for policy in ('forward', 'reverse', 'random:1', 'random:2'):
        out = np.zeros(2, np.float32)
        with schedule(policy):
            fn((1,), (256,), (x, out))
        assert out.tolist() == [x.sum(), 2 * x.sum()], policy


@pytest.mark.parametrize('name, block, message, marker', [
    ('half_warp_shuffle', 32, 'divergent shuffle: lane 0 waits for lane 16 (mask 0xffffffff), '
     'which has exited', '__shfl_down_sync(0xffffffffu, v, 1)'),
    ('mask_past_block', 48, 'names lanes that warp 1 of this 48-thread block lacks',
     '__shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1)'),
    ('early_exit_barrier', 64, '__syncthreads reached by 40 of 64 threads', 'tile[threadIdx.x] = x'),
    ('split_barrier', 64, 'threads meet different __syncthreads', '} else {'),
    ('two_shuffle_sites', 32, 'divergent shuffle', 'v = __shfl_sync(0xffffffffu, v, 1)'),
])
def test_broken_synchronization_names_kernel_and_line(custom, name, block, message, marker):
    fn = custom('bad', _BAD_KERNELS, name)
    args = {'early_exit_barrier': (np.ones(64, np.float32), np.zeros(64, np.float32), np.int32(40))}
    with pytest.raises(KernelError) as failure:
        fn((1,), (block,), args.get(name, (np.zeros(block, np.float32),)))
    text = str(failure.value)
    assert text.startswith(name + ' at cuda/bad.cu:'), text
    assert message in text, text
    line = int(text.split(':')[1])
    assert abs(line - _line(_BAD_KERNELS, marker)) <= 1, text


def test_shared_memory_starts_as_nan(custom):
    fn = custom('bad', _BAD_KERNELS, 'unwritten_shared')
    out = np.zeros(64, np.float32)
    fn((1,), (64,), (out,))
    assert (out[:32] == 1).all() and np.isnan(out[32:]).all()


def test_shuffles_wait_for_their_own_warp_only(custom):
    fn = custom('bad', _BAD_KERNELS, 'warp_local_shuffles')
    for policy in ('forward', 'reverse', 'random:3'):
        out = np.zeros(128, np.float32)
        with schedule(policy):
            fn((1,), (128,), (out,))
        t = np.arange(128)
        want = np.where((t // 32) % 2 == 0, t ^ 1, t)  # an odd number of swaps: t ^ 1
        assert out.tolist() == want.tolist(), policy


def test_partial_mask_and_width(custom):
    fn = custom('bad', _BAD_KERNELS, 'partial_mask_shuffle')
    out = np.zeros(64, np.float32)
    fn((1,), (64,), (out,))
    lane = np.arange(64) % 32
    want = np.where(lane < 8, np.arange(64) + 8, np.arange(64))
    assert out.tolist() == want.tolist()


@pytest.mark.parametrize('grid, block, message', [
    ((1,), (1025,), 'block.x must be in [1, 1024]'),
    ((1,), (32, 33), 'has 1056 threads, more than 1024'),
    ((1,), (1, 1, 65), 'block.z must be in [1, 64]'),
    ((1, 65536), (32,), 'grid.y must be in [1, 65535]'),
    ((1, 1, 65536), (32,), 'grid.z must be in [1, 65535]'),
    ((2 ** 31,), (32,), 'grid.x must be in [1, 2147483647]'),
    ((0,), (32,), 'grid.x must be in [1, 2147483647]'),
    ((1,), (129,), "more than 128 (its __launch_bounds__)"),
])
def test_launch_limits(custom, grid, block, message):
    fn = custom('bad', _BAD_KERNELS, 'bounded' if 'bounds' in message else 'half_warp_shuffle')
    with pytest.raises(KernelError, match=re.escape(message)):
        fn(grid, block, (np.zeros(2048, np.float32),))


def test_misaligned_vector_access_is_an_error(custom):
    code = ('#include "common.cuh"\nextern "C" __global__ void copy4(const float* x, float* y) {\n'
            '    float v[4];\n    load_vec<float, 4>(x + 4 * threadIdx.x, v);\n'
            '    store_vec<float, 4>(y + 4 * threadIdx.x, v);\n}\n')
    fn = custom('vec', code, 'copy4')
    x, y = np.arange(65, dtype=np.float32), np.zeros(64, np.float32)
    fn((1,), (16,), (x[:64], y))
    assert (y == x[:64]).all()
    with pytest.raises(KernelError, match=r'copy4 at cuda/common.cuh:\d+: misaligned address'):
        fn((1,), (16,), (x[1:], y))
