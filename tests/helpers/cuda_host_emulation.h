// Runs the kernels of cuda/*.cu on the CPU, for CI machines without a GPU
// (tests/cuda_emulation.py, tests/test_cuda_*.py). Included before a kernel source; g++ -std=c++20.
//
// The emulation is strict on purpose: a correct kernel gives a GPU's results, an incorrect
// one an error or a wrong number, never a lucky pass.
//   * Every CUDA thread is a fiber of the one calling thread (a hand-written x86-64 stack
//     switch: glibc's swapcontext makes a system call per switch). Blocks run one after
//     another, in the order of the schedule policy.
//   * Warps are 32 consecutive threads (linear id / 32). A shuffle waits for the lanes of its
//     own mask only, so warps drift apart between barriers as on a GPU; the scheduler runs
//     one warp until all of its lanes wait (warp-eager), which is the order that exposes a
//     missing __syncthreads before reused shared memory.
//   * Schedule policies: forward, reverse, or seeded random order of blocks, warps and lanes.
//   * `__shared__` memory is filled with 0xFF bytes (a NaN in float16/32/64) before each block.
//   * Errors stop the launch with the kernel's name and the file:line of the call: a shuffle
//     whose mask names lanes that exit, wait elsewhere or do not exist; a __syncthreads that
//     some threads skip (exit) or meet at another call site; a deadlock; a misaligned access
//     (the build's -fsanitize=alignment calls __ubsan_handle_type_mismatch_v1 below).
// Launch limits (block <= 1024 threads, grid.y/z <= 65535, ...) are checked by the caller.
// EMULATE(name) exports `emu_<name>`, a pointer to a launcher
//   int launch(const EmuLaunchConfig*, <kernel args...>)   (0, or 1 with emu_last_error())
#pragma once
#define CAFFE_SYNCBN_HOST_EMULATION 1
#include <sys/mman.h>

#include <algorithm>
#include <cstdarg>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <source_location>
#include <string>
#include <vector>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

// The emulation's own functions, which ThreadSanitizer must not watch (see below).
#if defined(__SANITIZE_THREAD__)
#define EMU_HOST __attribute__((no_sanitize("thread")))
#else
#define EMU_HOST
#endif

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
static dim3 gridDim, blockDim, blockIdx, threadIdx;

// One launch, as tests/cuda_emulation.py passes it. `only_blocks` (count > 0) runs just those
// blocks (x, y, z triples) of the grid: a test of index arithmetic past 2^31 runs the last
// blocks of a huge grid over a sparse mapping instead of billions of threads.
struct EmuLaunchConfig {
    unsigned grid[3], block[3];
    int policy;  // 0 forward, 1 reverse, 2 random
    unsigned seed;
    const char* kernel;
    unsigned only_count;
    const unsigned* only_blocks;
};

namespace emu {

enum State { READY, AT_SHUFFLE, AT_BARRIER, DONE };
enum Policy { FORWARD = 0, REVERSE = 1, RANDOM = 2 };

struct Thread {
    State state;
    void* sp;
    void* stack_base;  // lowest address of this fiber's stack
    std::source_location site;  // where the thread waits (shuffle or barrier)
    unsigned mask, src;         // shuffle: lanes it waits for, lane it reads
    unsigned char value[8], result[8];
};

static std::vector<Thread> threads;
static unsigned current, nthreads;
static void* scheduler_sp;
static const char* kernel_name = "?";
static std::string error;
static std::mt19937 rng;
static int policy;
static std::function<void()> body;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
static constexpr size_t STACK = 512 * 1024;  // sanitizers' frames are larger
#else
static constexpr size_t STACK = 64 * 1024;
#endif
static char* stacks;  // 1024 stacks, reserved once, touched only as deep as a kernel goes

#if defined(__SANITIZE_THREAD__)
// Fibers do not synchronize by switching (no_sync): only barriers and shuffles order the
// threads of a block, so ThreadSanitizer reports their plain accesses that race. Blocks are
// ordered one after the other (the host acquires what a block did before the next starts):
// the __shared__ variables, which every block reuses here, would race otherwise. The
// emulation's own bookkeeping is not instrumented (EMU_HOST).
static void* tsan_fiber[1024];
static void* tsan_host;
static char tsan_block_start, tsan_block_end;
// A barrier or shuffle orders its threads through a fresh sync object: malloc'd, so that
// freeing it forgets the clocks and one block's barrier does not order the next block.
EMU_HOST static void tsan_exchange(const unsigned* members, unsigned count) {
    char* sync = static_cast<char*>(malloc(1));
    for (unsigned k = 0; k < count; ++k) {
        __tsan_switch_to_fiber(tsan_fiber[members[k]], __tsan_switch_to_fiber_no_sync);
        __tsan_release(sync);
    }
    for (unsigned k = 0; k < count; ++k) {
        __tsan_switch_to_fiber(tsan_fiber[members[k]], __tsan_switch_to_fiber_no_sync);
        __tsan_acquire(sync);
    }
    __tsan_switch_to_fiber(tsan_host, __tsan_switch_to_fiber_no_sync);
    free(sync);
}
#endif
#if defined(__SANITIZE_ADDRESS__)
static const void* asan_host_bottom;
static size_t asan_host_size;
static bool stacks_dirty;  // a launch stopped with fibers mid-call
#endif

// ---- the stack switch -------------------------------------------------------------------
#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores its pointer in *from, and
// resumes the stack `to` (System V x86-64: rbx, rbp, r12-r15 are the callee-saved ones).
extern "C" void emu_switch_stack(void** from, void* to);
asm(R"(
    .text
    .p2align 4
    .type emu_switch_stack, @function
emu_switch_stack:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_stack, .-emu_switch_stack
)");
#endif

static void fiber_main();

#if defined(__x86_64__)
// A fresh stack that "returns" into fiber_main with the alignment of a called function.
EMU_HOST static void* fresh_stack(char* base) {
    auto* top = reinterpret_cast<void**>(base + STACK);
    *--top = nullptr;                                   // fiber_main's return address: never used
    *--top = reinterpret_cast<void*>(&fiber_main);      // what emu_switch_stack's ret pops
    for (int k = 0; k < 6; ++k) *--top = nullptr;      // r15 ... rbp
    return top;
}
#else
static ucontext_t contexts[1025];  // [1024] is the scheduler
EMU_HOST static void* fresh_stack(char* base) {
    const unsigned t = (unsigned)((base - stacks) / STACK);
    getcontext(&contexts[t]);
    contexts[t].uc_stack.ss_sp = base;
    contexts[t].uc_stack.ss_size = STACK;
    contexts[t].uc_link = nullptr;
    makecontext(&contexts[t], fiber_main, 0);
    return &contexts[t];
}
#endif

EMU_HOST static void switch_to(void** from, void* to, const void* to_stack, size_t to_size, void* to_tsan) {
#if defined(__SANITIZE_ADDRESS__)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, to_stack, to_size);
#else
    (void)to_stack;
    (void)to_size;
#endif
#if defined(__SANITIZE_THREAD__)
    __tsan_switch_to_fiber(to_tsan, __tsan_switch_to_fiber_no_sync);
#else
    (void)to_tsan;
#endif
#if defined(__x86_64__)
    emu_switch_stack(from, to);
#else
    swapcontext(static_cast<ucontext_t*>(*from), static_cast<ucontext_t*>(to));
#endif
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

// From the running fiber back to the scheduler.
EMU_HOST static void yield() {
#if defined(__x86_64__)
    void** from = &threads[current].sp;
#else
    void* ctx = &contexts[current];
    void** from = &ctx;
#endif
#if defined(__SANITIZE_THREAD__)
    void* host = tsan_host;
#else
    void* host = nullptr;
#endif
#if defined(__SANITIZE_ADDRESS__)
    switch_to(from, scheduler_sp, asan_host_bottom, asan_host_size, host);
#else
    switch_to(from, scheduler_sp, nullptr, 0, host);
#endif
}

static void fail(const std::source_location& at, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));
EMU_HOST static void fail(const std::source_location& at, const char* fmt, ...) {
    char text[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(text, sizeof text, fmt, args);
    va_end(args);
    if (error.empty())
        error = std::string(kernel_name) + " at " + at.file_name() + ":" +
                std::to_string(at.line()) + ": " + text;
}

EMU_HOST static void fiber_main() {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(nullptr, &asan_host_bottom, &asan_host_size);
#endif
#if defined(__SANITIZE_THREAD__)
    __tsan_acquire(&tsan_block_start);
#endif
    body();
#if defined(__SANITIZE_THREAD__)
    __tsan_release(&tsan_block_end);
#endif
    threads[current].state = DONE;
    yield();
    __builtin_unreachable();  // a finished fiber is never resumed
}

EMU_HOST static std::string where(const Thread& t) {
    return std::string(t.site.file_name()) + ":" + std::to_string(t.site.line());
}

EMU_HOST static std::string describe(unsigned t) {
    const Thread& th = threads[t];
    switch (th.state) {
    case DONE: return "has exited";
    case AT_BARRIER: return "waits at __syncthreads at " + where(th);
    case AT_SHUFFLE: return "waits at a shuffle at " + where(th);
    default: return "is running";
    }
}

// The lanes of warp w that exist (a last warp may be partial).
EMU_HOST static unsigned warp_lanes(unsigned w) {
    const unsigned n = std::min(32u, nthreads - w * 32);
    return n == 32 ? 0xffffffffu : (1u << n) - 1;
}

// Called when thread t has arrived at a shuffle: completes it when every lane of the mask has.
EMU_HOST static void try_shuffle(unsigned t) {
    const unsigned w = t / 32, base = w * 32;
    const Thread& me = threads[t];
    for (unsigned lane = 0; lane < 32; ++lane) {
        if (!(me.mask >> lane & 1)) continue;
        const Thread& other = threads[base + lane];
        if (other.state == READY) return;  // not there yet
        if (other.state == AT_SHUFFLE &&
            (other.mask != me.mask || other.site.line() != me.site.line() ||
             std::strcmp(other.site.file_name(), me.site.file_name()) != 0)) {
            fail(me.site, "divergent shuffle: lane %u waits here with mask 0x%08x, lane %u at %s "
                 "with mask 0x%08x", t % 32, me.mask, lane, where(other).c_str(), other.mask);
            return;
        }
        if (other.state != AT_SHUFFLE) return;  // found stuck later, with a full report
    }
#if defined(__SANITIZE_THREAD__)
    unsigned members[32], count = 0;
    for (unsigned lane = 0; lane < 32; ++lane)
        if (me.mask >> lane & 1) members[count++] = base + lane;
    tsan_exchange(members, count);
#endif
    for (unsigned lane = 0; lane < 32; ++lane) {
        if (!(me.mask >> lane & 1)) continue;
        Thread& other = threads[base + lane];
        if (!(me.mask >> other.src & 1)) {
            fail(other.site, "lane %u reads lane %u, which is not in the shuffle's mask 0x%08x",
                 lane, other.src, me.mask);
            return;
        }
        std::memcpy(other.result, threads[base + other.src].value, 8);
        other.state = READY;
    }
}

// Nothing can run: every thread has exited, or all that have not wait at one __syncthreads
// (released here), or the block is stuck (an error that says who waits where).
EMU_HOST static bool release_or_fail() {
    unsigned done = 0, barrier = 0, first_barrier = 0, first_done = 0;
    for (unsigned t = 0; t < nthreads; ++t) {
        const Thread& th = threads[t];
        if (th.state == AT_SHUFFLE) {
            const unsigned base = t / 32 * 32;
            for (unsigned lane = 0; lane < 32; ++lane)
                if ((th.mask >> lane & 1) && threads[base + lane].state != AT_SHUFFLE) {
                    fail(th.site, "divergent shuffle: lane %u waits for lane %u (mask 0x%08x), "
                         "which %s", t % 32, lane, th.mask, describe(base + lane).c_str());
                    return false;
                }
            fail(th.site, "deadlock at a shuffle");
            return false;
        }
        if (th.state == DONE && done++ == 0) first_done = t;
        if (th.state == AT_BARRIER && barrier++ == 0) first_barrier = t;
    }
    if (barrier == 0) return false;  // all done
    const Thread& b = threads[first_barrier];
    if (done > 0) {
        fail(b.site, "__syncthreads reached by %u of %u threads: thread %u has exited",
             barrier, nthreads, first_done);
        return false;
    }
    for (unsigned t = 0; t < nthreads; ++t) {
        const Thread& th = threads[t];
        if (th.site.line() != b.site.line() ||
            std::strcmp(th.site.file_name(), b.site.file_name()) != 0) {
            fail(b.site, "threads meet different __syncthreads: thread %u here, thread %u at %s",
                 first_barrier, t, where(th).c_str());
            return false;
        }
    }
#if defined(__SANITIZE_THREAD__)
    std::vector<unsigned> members(nthreads);
    for (unsigned t = 0; t < nthreads; ++t) members[t] = t;
    tsan_exchange(members.data(), nthreads);
#endif
    for (auto& th : threads) th.state = READY;
    return true;
}

// __shared__ variables live in one section; 0xFF bytes make every float type read a NaN.
// (weak: a kernel file without __shared__ variables has no such section)
extern "C" __attribute__((weak)) char __start_emu_shared[], __stop_emu_shared[];
__attribute__((no_sanitize("address", "thread"))) static void poison_shared() {
    for (volatile char* p = __start_emu_shared; p < __stop_emu_shared; ++p) *p = (char)0xFF;
}

EMU_HOST static void order(std::vector<unsigned>& items) {
    if (policy == REVERSE) std::reverse(items.begin(), items.end());
    if (policy == RANDOM) std::shuffle(items.begin(), items.end(), rng);
}

EMU_HOST static void run(unsigned t) {
    current = t;
    threadIdx = {t % blockDim.x, t / blockDim.x % blockDim.y, t / (blockDim.x * blockDim.y)};
#if defined(__x86_64__)
    void* to = threads[t].sp;
#else
    void* to = &contexts[t];
#endif
#if defined(__SANITIZE_THREAD__)
    void* fiber = tsan_fiber[t];
#else
    void* fiber = nullptr;
#endif
#if defined(__x86_64__)
    switch_to(&scheduler_sp, to, threads[t].stack_base, STACK, fiber);
#else
    void* self = &contexts[1024];
    scheduler_sp = self;
    void** from = &self;
    switch_to(from, to, threads[t].stack_base, STACK, fiber);
#endif
}

// One block: warp after warp, each run until all of its lanes wait or have exited; then the
// barrier (if every thread is at it) opens and the round repeats.
EMU_HOST static bool run_block() {
    poison_shared();
#if defined(__SANITIZE_ADDRESS__)
    if (stacks_dirty) {  // a failed launch left its frames' redzones
        __asan_unpoison_memory_region(stacks, 1024 * STACK);
        stacks_dirty = false;
    }
#endif
    for (unsigned t = 0; t < nthreads; ++t) {
        Thread& th = threads[t];
        th.state = READY;
        th.stack_base = stacks + (size_t)t * STACK;
        th.sp = fresh_stack(static_cast<char*>(th.stack_base));
    }
    const unsigned nwarps = (nthreads + 31) / 32;
    std::vector<unsigned> warps(nwarps), lanes;
    for (;;) {
        for (unsigned w = 0; w < nwarps; ++w) warps[w] = w;
        order(warps);
        for (unsigned w : warps) {
            const unsigned n = std::min(32u, nthreads - w * 32);
            for (bool again = true; again;) {
                again = false;
                lanes.resize(n);
                for (unsigned l = 0; l < n; ++l) lanes[l] = w * 32 + l;
                order(lanes);
                for (unsigned t : lanes) {
                    if (threads[t].state != READY) continue;
                    run(t);
                    if (threads[t].state == AT_SHUFFLE) try_shuffle(t);
                    if (!error.empty()) return false;
                    again = true;
                }
            }
        }
        if (!release_or_fail()) return error.empty();
    }
}

}  // namespace emu

EMU_HOST inline void __syncthreads(std::source_location at = std::source_location::current()) {
    emu::Thread& me = emu::threads[emu::current];
    me.site = at;
    me.state = emu::AT_BARRIER;
    emu::yield();
}

enum EmuShuffle { EMU_IDX, EMU_UP, EMU_DOWN, EMU_XOR };

template <class T>
EMU_HOST T emu_shuffle(unsigned mask, T v, EmuShuffle kind, int arg, int width,
              const std::source_location& at) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    using namespace emu;
    Thread& me = threads[current];
    const unsigned t = current, lane = t % 32;
    if (width < 1 || width > 32 || (width & (width - 1)) != 0)
        fail(at, "shuffle width %d is not a power of two in [1, 32]", width);
    else if (!(mask >> lane & 1))
        fail(at, "lane %u calls a shuffle whose mask 0x%08x leaves it out", lane, mask);
    else if (mask & ~warp_lanes(t / 32))
        fail(at, "shuffle mask 0x%08x names lanes that warp %u of this %u-thread block lacks",
             mask, t / 32, nthreads);
    if (!error.empty()) {
        me.state = DONE;
        yield();
    }
    const unsigned w = (unsigned)width, segment = lane & ~(w - 1), in = lane & (w - 1);
    unsigned src = lane;
    switch (kind) {
    case EMU_IDX: src = segment + ((unsigned)arg & (w - 1)); break;
    case EMU_UP: src = in >= (unsigned)arg ? lane - arg : lane; break;
    case EMU_DOWN: src = in + (unsigned)arg < w ? lane + arg : lane; break;
    case EMU_XOR: src = lane ^ (unsigned)arg; src = (src & ~(w - 1)) <= segment ? src : lane; break;
    }
    me.src = src;
    me.mask = mask;
    me.site = at;
    std::memset(me.value, 0, 8);
    std::memcpy(me.value, &v, sizeof(T));
    me.state = AT_SHUFFLE;
    yield();
    T r;
    std::memcpy(&r, me.result, sizeof(T));
    return r;
}

template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32,
              std::source_location at = std::source_location::current()) {
    return emu_shuffle(mask, v, EMU_IDX, src, width, at);
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32,
                 std::source_location at = std::source_location::current()) {
    return emu_shuffle(mask, v, EMU_UP, (int)delta, width, at);
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32,
                   std::source_location at = std::source_location::current()) {
    return emu_shuffle(mask, v, EMU_DOWN, (int)delta, width, at);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32,
                  std::source_location at = std::source_location::current()) {
    return emu_shuffle(mask, v, EMU_XOR, lane_mask, width, at);
}

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static __attribute__((section("emu_shared")))
#define __align__(n) alignas(n)
#define __restrict__ __restrict

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

// Every blockIdx of the launch (or the chosen ones), in the policy's order.
EMU_HOST static std::vector<dim3> emu_blocks(const EmuLaunchConfig& c) {
    std::vector<dim3> blocks;
    if (c.only_count > 0) {
        for (unsigned k = 0; k < c.only_count; ++k)
            blocks.push_back({c.only_blocks[3 * k], c.only_blocks[3 * k + 1], c.only_blocks[3 * k + 2]});
    } else {
        for (unsigned z = 0; z < c.grid[2]; ++z)
            for (unsigned y = 0; y < c.grid[1]; ++y)
                for (unsigned x = 0; x < c.grid[0]; ++x) blocks.push_back({x, y, z});
    }
    if (emu::policy == emu::REVERSE) std::reverse(blocks.begin(), blocks.end());
    if (emu::policy == emu::RANDOM) std::shuffle(blocks.begin(), blocks.end(), emu::rng);
    return blocks;
}

EMU_HOST static int emu_launch(const EmuLaunchConfig& c) {
    using namespace emu;
    if (stacks == nullptr) {
        void* p = mmap(nullptr, 1024 * STACK, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            error = "cannot reserve the fibers' stacks";
            return 1;
        }
        stacks = static_cast<char*>(p);
        threads.resize(1024);
#if defined(__SANITIZE_THREAD__)
        tsan_host = __tsan_get_current_fiber();
        for (auto& f : tsan_fiber) f = __tsan_create_fiber(0);
#endif
    }
#if defined(__SANITIZE_ADDRESS__)
    stacks_dirty = stacks_dirty || !error.empty();
#endif
    error.clear();
    kernel_name = c.kernel;
    policy = c.policy;
    rng.seed(c.seed);
    gridDim = {c.grid[0], c.grid[1], c.grid[2]};
    blockDim = {c.block[0], c.block[1], c.block[2]};
    nthreads = c.block[0] * c.block[1] * c.block[2];
    for (const dim3& b : emu_blocks(c)) {
        blockIdx = b;
#if defined(__SANITIZE_THREAD__)
        __tsan_release(&tsan_block_start);
#endif
        if (!run_block()) return 1;
#if defined(__SANITIZE_THREAD__)
        __tsan_acquire(&tsan_block_end);
#endif
    }
    return 0;
}

// The library is built with -fsanitize=alignment, whose checks call this handler (defined
// here, so no UBSan runtime is needed): a vector access through a pointer that lacks its
// alignment faults on a GPU ("misaligned address"), so it stops the kernel here too.
struct EmuUbsanLocation {
    const char* file;
    unsigned line, column;
};
struct EmuUbsanType {
    unsigned short kind, info;
    char name[1];
};
struct EmuUbsanMismatch {
    EmuUbsanLocation at;
    const EmuUbsanType* type;
    unsigned char log_alignment, check_kind;
};
extern "C" EMU_HOST __attribute__((visibility("hidden"))) void __ubsan_handle_type_mismatch_v1(
    EmuUbsanMismatch* data, void* pointer) {
    if (emu::error.empty())
        emu::error = std::string(emu::kernel_name) + " at " + data->at.file + ":" +
                     std::to_string(data->at.line) + ": misaligned address " +
                     std::to_string(reinterpret_cast<uintptr_t>(pointer)) + " for type " +
                     data->type->name + ", which needs " +
                     std::to_string(1u << data->log_alignment) + "-byte alignment";
    emu::threads[emu::current].state = emu::DONE;
    emu::yield();
}

extern "C" const char* emu_last_error() { return emu::error.c_str(); }

template <class F> struct EmuLaunch;
template <class... Args> struct EmuLaunch<void (*)(Args...)> {
    template <void (*Kernel)(Args...)>
    EMU_HOST static int run(const EmuLaunchConfig* config, Args... args) {
        emu::body = [=] { Kernel(args...); };
        return emu_launch(*config);
    }
};

#define EMULATE(name) \
    extern "C" void* emu_##name = (void*)&EmuLaunch<decltype(&name)>::template run<&name>;
