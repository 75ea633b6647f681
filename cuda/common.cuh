// Shared helpers of the kernels in this folder. No system headers: the same text compiles with
// nvcc and with NVRTC (CuPy's RawModule), which has no C library. The loader
// (caffe_syncbn/backend/cuda_kernels.py) pastes this file in place of `#include "common.cuh"`.
//
//   half_t       a float16 value as its 16 bits (the kernels take CuPy float16 arrays)
//   to_float     float16/float32/float64 -> the accumulation type
//   from_acc     back to the storage type, rounding to nearest
//   acc_t<T>     float for float16/float32, double for float64
//   Vec<T, N>    N consecutive values loaded or stored with one 4/8/16-byte access
#pragma once

typedef long long i64;
typedef unsigned long long u64;

struct __align__(2) half_t {
    unsigned short bits;
};

#ifndef CAFFE_SYNCBN_HOST_EMULATION
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#else  // the CPU run of the kernels in tests/ (cuda_host_emulation.h): the compiler's float16
inline float half_bits_to_float(unsigned short h) {
    _Float16 v;
    __builtin_memcpy(&v, &h, 2);
    return (float)v;
}

inline unsigned short float_to_half_bits(float f) {
    _Float16 v = (_Float16)f;
    unsigned short h;
    __builtin_memcpy(&h, &v, 2);
    return h;
}
#endif

template <class T> struct acc_type { typedef float type; };
template <> struct acc_type<double> { typedef double type; };
template <class T> using acc_t = typename acc_type<T>::type;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ double to_float(double v) { return v; }
__device__ __forceinline__ float to_float(half_t v) { return half_bits_to_float(v.bits); }

template <class T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(float v) { return v; }
template <> __device__ __forceinline__ half_t from_acc<half_t>(float v) {
    half_t h;
    h.bits = float_to_half_bits(v);
    return h;
}
template <class T> __device__ __forceinline__ T from_acc(double v) { return (T)v; }

// N values of type T that travel as one aligned access: float x4 and half x8 are 16 bytes.
template <class T, int N> struct __align__(sizeof(T) * N) Vec {
    T v[N];
};

template <class T, int N, class A>
__device__ __forceinline__ void load_vec(const T* p, A (&out)[N]) {
    Vec<T, N> raw = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = to_float(raw.v[k]);
}

template <class T, int N, class A>
__device__ __forceinline__ void store_vec(T* p, const A (&in)[N]) {
    Vec<T, N> raw;
#pragma unroll
    for (int k = 0; k < N; ++k) raw.v[k] = from_acc<T>(in[k]);
    *reinterpret_cast<Vec<T, N>*>(p) = raw;
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<u64>(p) & 15ull) == 0;
}

// Sum of one value over a block (blockDim.x a multiple of 32, at most 1024), via warp shuffles
// then one shared-memory round. Every thread gets the total. `scratch` holds >= 32 values.
template <class A>
__device__ __forceinline__ A block_sum(A v, A* scratch) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int nwarps = (blockDim.x + 31) >> 5;
    v = lane < nwarps ? scratch[lane] : A(0);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return __shfl_sync(0xffffffffu, v, 0);
}
