// The same-device communicator's kernels (caffe_syncbn/comm/same_device.py, launched by
// caffe_syncbn/backend/cuda_runtime.py): several replicas share one GPU, so an allreduce is
// a sum of R device buffers in fixed rank order, then a copy of the sum back into each
// replica's buffer. Buffers are contiguous, of n values of
// type T: _f16 (summed in float32, rounded once per launch), _f32, _f64.
//
// Launch shapes: 1-D grid-stride, 256 threads per block, grid = min(ceil(n/V/256), 32*SMs),
// V = 16/sizeof(T) values per thread and step when every pointer is 16-byte aligned and
// n % V == 0, else 1.
//
// reduce_sum8_<t>(s0, ..., s7, nsrc, accumulate, dst, n)
//   reads  s0..s[nsrc-1] (1 <= nsrc <= 8; the unused pointers are ignored) and, when
//          accumulate != 0, dst itself
//   writes dst[i] = (((dst[i]) + s0[i]) + s1[i]) + ...   (accumulate != 0)
//          dst[i] = ((s0[i] + s1[i]) + s2[i]) + ...      (accumulate == 0)
//   R > 8 replicas chain launches of 8 (accumulate=1 after the first): the order of the
//   additions, hence every bit of the result, is the rank order whatever R is.
//
// reduce_copy_<t>(src, dst, n)
//   reads src, writes dst[i] = src[i] (the copy-out of the sum into one replica's buffer).
#include "common.cuh"

template <class T>
__device__ void sum8(const T* s0, const T* s1, const T* s2, const T* s3, const T* s4,
                     const T* s5, const T* s6, const T* s7, int nsrc, int accumulate, T* dst,
                     i64 n) {
    typedef acc_t<T> A;
    constexpr int V = 16 / sizeof(T);
    const T* src[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
    bool vec = n % V == 0 && aligned16(dst);
#pragma unroll
    for (int k = 0; k < 8; ++k) vec = vec && (k >= nsrc || aligned16(src[k]));
    const int width = vec ? V : 1;
    const i64 stride = (i64)blockDim.x * gridDim.x * width;
    for (i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * width; i < n; i += stride) {
        if (vec) {
            A acc[V], add[V];
            if (accumulate) {
                load_vec<T, V>(dst + i, acc);
            } else {
                load_vec<T, V>(src[0] + i, acc);
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                if (k < (accumulate ? 0 : 1) || k >= nsrc) continue;
                load_vec<T, V>(src[k] + i, add);
#pragma unroll
                for (int j = 0; j < V; ++j) acc[j] += add[j];
            }
            store_vec<T, V>(dst + i, acc);
        } else {
            A acc = to_float(accumulate ? dst[i] : src[0][i]);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                if (k < (accumulate ? 0 : 1) || k >= nsrc) continue;
                acc += to_float(src[k][i]);
            }
            dst[i] = from_acc<T>(acc);
        }
    }
}

template <class T>
__device__ void copy(const T* src, T* dst, i64 n) {
    constexpr int V = 16 / sizeof(T);
    const bool vec = n % V == 0 && aligned16(src) && aligned16(dst);
    const int width = vec ? V : 1;
    const i64 stride = (i64)blockDim.x * gridDim.x * width;
    for (i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * width; i < n; i += stride) {
        if (vec) {
            *reinterpret_cast<Vec<T, V>*>(dst + i) = *reinterpret_cast<const Vec<T, V>*>(src + i);
        } else {
            dst[i] = src[i];
        }
    }
}

#define REDUCE_INSTANTIATE(T, SUFFIX)                                                          \
    extern "C" __global__ void reduce_sum8_##SUFFIX(                                           \
        const T* s0, const T* s1, const T* s2, const T* s3, const T* s4, const T* s5,          \
        const T* s6, const T* s7, int nsrc, int accumulate, T* dst, i64 n) {                   \
        sum8<T>(s0, s1, s2, s3, s4, s5, s6, s7, nsrc, accumulate, dst, n);                     \
    }                                                                                          \
    extern "C" __global__ void reduce_copy_##SUFFIX(const T* src, T* dst, i64 n) {             \
        copy<T>(src, dst, n);                                                                  \
    }

REDUCE_INSTANTIATE(half_t, f16)
REDUCE_INSTANTIATE(float, f32)
REDUCE_INSTANTIATE(double, f64)
