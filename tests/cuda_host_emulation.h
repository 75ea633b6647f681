// Runs the kernels of cuda/*.cu on the CPU, for CI machines without a GPU
// (tests/test_cuda_emulated_*.py). Included before a kernel source; g++ -std=c++20.
//
// Every CUDA thread of a block is a fiber (ucontext) of the one calling thread; blocks run
// one after another, so `__shared__` variables become function statics. __syncthreads parks
// the fiber until every fiber of the block has reached it (or finished), and a warp shuffle
// is an exchange through a block-wide buffer between two barriers, which is exact for code
// where the whole block shuffles together (block_sum in common.cuh).
// EMULATE(name) exports `emu_<name>`, a pointer to a launcher
//   void launch(unsigned gx, unsigned gy, unsigned gz, unsigned block, <kernel args...>)
#pragma once
#define CAFFE_SYNCBN_HOST_EMULATION 1
#include <ucontext.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
static dim3 gridDim, blockDim, blockIdx, threadIdx;
static unsigned char emu_exchange[1024 * 8];

enum EmuState { EMU_READY, EMU_AT_BARRIER, EMU_DONE };
static ucontext_t emu_scheduler;
static std::vector<ucontext_t> emu_fibers;
static std::vector<EmuState> emu_states;
static std::function<void()> emu_body;

static void emu_fiber_main() {
    emu_body();
    emu_states[threadIdx.x] = EMU_DONE;  // uc_link returns to the scheduler
}

inline void __syncthreads() {
    emu_states[threadIdx.x] = EMU_AT_BARRIER;
    swapcontext(&emu_fibers[threadIdx.x], &emu_scheduler);
}

// One block: run every fiber up to its next barrier (or its end), release them, repeat.
static void emu_run_block(unsigned block) {
    constexpr size_t STACK = 64 * 1024;
    static std::vector<char> stacks;
    stacks.resize(block * STACK);
    emu_fibers.assign(block, ucontext_t());
    emu_states.assign(block, EMU_READY);
    for (unsigned t = 0; t < block; ++t) {
        getcontext(&emu_fibers[t]);
        emu_fibers[t].uc_stack.ss_sp = stacks.data() + t * STACK;
        emu_fibers[t].uc_stack.ss_size = STACK;
        emu_fibers[t].uc_link = &emu_scheduler;
        makecontext(&emu_fibers[t], emu_fiber_main, 0);
    }
    for (bool running = true; running;) {
        running = false;
        for (unsigned t = 0; t < block; ++t) {
            if (emu_states[t] != EMU_READY) continue;
            threadIdx = {t, 0, 0};
            swapcontext(&emu_scheduler, &emu_fibers[t]);
        }
        for (auto& state : emu_states)
            if (state == EMU_AT_BARRIER) {
                state = EMU_READY;
                running = true;
            }
    }
}

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)
#define __restrict__ __restrict

template <class T>
T emu_exchange_with(T v, unsigned src_thread) {
    std::memcpy(emu_exchange + threadIdx.x * 8, &v, sizeof(T));
    __syncthreads();
    T r = v;
    if (src_thread < blockDim.x) std::memcpy(&r, emu_exchange + src_thread * 8, sizeof(T));
    __syncthreads();
    return r;
}
template <class T> T __shfl_down_sync(unsigned, T v, int offset) {
    const unsigned lane = threadIdx.x & 31u;
    return emu_exchange_with(v, lane + offset < 32 ? threadIdx.x + offset : blockDim.x);
}
template <class T> T __shfl_sync(unsigned, T v, int src_lane) {
    return emu_exchange_with(v, (threadIdx.x & ~31u) + (unsigned)src_lane);
}
template <class T> T __shfl_xor_sync(unsigned, T v, int mask) {
    return emu_exchange_with(v, (threadIdx.x & ~31u) + ((threadIdx.x & 31u) ^ (unsigned)mask));
}

template <class T> T atomicAdd(T* address, T value) {
    return std::atomic_ref<T>(*address).fetch_add(value);
}

inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline double rsqrt(double v) { return 1.0 / std::sqrt(v); }
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float v) { int i; std::memcpy(&i, &v, 4); return i; }
template <class T> T __ldg(const T* p) { return *p; }
using std::max;
using std::min;

template <class F> struct EmuLaunch;
template <class... Args> struct EmuLaunch<void (*)(Args...)> {
    template <void (*Kernel)(Args...)>
    static void run(unsigned gx, unsigned gy, unsigned gz, unsigned block, Args... args) {
        gridDim = {gx, gy, gz};
        blockDim = {block, 1, 1};
        emu_body = [=] { Kernel(args...); };
        for (unsigned z = 0; z < gz; ++z)
            for (unsigned y = 0; y < gy; ++y)
                for (unsigned x = 0; x < gx; ++x) {
                    blockIdx = {x, y, z};
                    emu_run_block(block);
                }
    }
};

#define EMULATE(name) \
    extern "C" void* emu_##name = (void*)&EmuLaunch<decltype(&name)>::template run<&name>;
