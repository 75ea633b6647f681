// Local response normalization across channels (caffe_syncbn/layers/lrn/gpu.py), on contiguous
// (N, C, HW) arrays: scale = k + alpha/size * sum of x^2 over the `size` channels centred on c
// (zero outside), y = x * scale^-beta. WITHIN_CHANNEL stays on the array code of layers/lrn/layers.py.
// _f16, _f32, _f64: the element type; arithmetic in float32 (float16, float32) or float64.
//
// Launch shapes: 1-D grid-stride over the N*HW columns, 256 threads per block,
// grid = min(ceil(N*HW/256), 32*SMs). Each thread walks the C channels of one (n, hw) column
// with a sliding window sum (adds the channel entering, drops the one leaving).
//
// lrn_across_forward_<t>(x, N, C, HW, size, alpha_over_size, beta, k, scale, y)
//   reads x; writes scale (kept for backward) and y.
// lrn_across_backward_<t>(x, y, scale, dy, N, C, HW, size, ratio, beta, dx)
//   ratio = 2*alpha*beta/size; reads x, y, scale, dy; writes
//   dx = dy*scale^-beta - ratio * x * (window sum of dy*y/scale).
#include "common.cuh"

#define GRID_STRIDE(t, n) \
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < (n); t += (i64)blockDim.x * gridDim.x)

__device__ __forceinline__ float pow_acc(float b, float e) { return powf(b, e); }
__device__ __forceinline__ double pow_acc(double b, double e) { return pow(b, e); }

template <class T>
__device__ void forward(const T* __restrict__ x, int N, int C, i64 HW, int size,
                        double alpha_over_size, double beta, double k, T* __restrict__ scale,
                        T* __restrict__ y) {
    typedef acc_t<T> A;
    const int half = (size - 1) / 2;
    GRID_STRIDE(t, (i64)N * HW) {
        const i64 base = (t / HW) * C * HW + t % HW;
        A window = 0;
        for (int c = 0; c < half && c < C; ++c) {
            const A v = to_float(x[base + c * HW]);
            window += v * v;
        }
        for (int c = 0; c < C; ++c) {
            if (c + half < C) {
                const A v = to_float(x[base + (c + half) * HW]);
                window += v * v;
            }
            const A s = (A)k + (A)alpha_over_size * window;
            const i64 at = base + c * HW;
            scale[at] = from_acc<T>(s);
            y[at] = from_acc<T>(to_float(x[at]) * pow_acc(s, (A)-beta));
            if (c - half >= 0) {
                const A v = to_float(x[base + (c - half) * HW]);
                window -= v * v;
            }
        }
    }
}

template <class T>
__device__ void backward(const T* __restrict__ x, const T* __restrict__ y,
                         const T* __restrict__ scale, const T* __restrict__ dy, int N, int C,
                         i64 HW, int size, double ratio, double beta, T* __restrict__ dx) {
    typedef acc_t<T> A;
    const int half = (size - 1) / 2;
    GRID_STRIDE(t, (i64)N * HW) {
        const i64 base = (t / HW) * C * HW + t % HW;
        // term(c) = dy*y/scale at channel c
#define LRN_TERM(c) (to_float(dy[base + (c) * HW]) * to_float(y[base + (c) * HW]) / \
                     to_float(scale[base + (c) * HW]))
        A window = 0;
        for (int c = 0; c < half && c < C; ++c) window += LRN_TERM(c);
        for (int c = 0; c < C; ++c) {
            if (c + half < C) window += LRN_TERM(c + half);
            const i64 at = base + c * HW;
            dx[at] = from_acc<T>(to_float(dy[at]) * pow_acc(to_float(scale[at]), (A)-beta) -
                                 (A)ratio * to_float(x[at]) * window);
            if (c - half >= 0) window -= LRN_TERM(c - half);
        }
#undef LRN_TERM
    }
}

#define LRN_INSTANTIATE(T, SUFFIX)                                                              \
    extern "C" __global__ void lrn_across_forward_##SUFFIX(                                     \
        const T* x, int N, int C, i64 HW, int size, double alpha_over_size, double beta,        \
        double k, T* scale, T* y) {                                                             \
        forward<T>(x, N, C, HW, size, alpha_over_size, beta, k, scale, y);                      \
    }                                                                                           \
    extern "C" __global__ void lrn_across_backward_##SUFFIX(                                    \
        const T* x, const T* y, const T* scale, const T* dy, int N, int C, i64 HW, int size,    \
        double ratio, double beta, T* dx) {                                                     \
        backward<T>(x, y, scale, dy, N, C, HW, size, ratio, beta, dx);                          \
    }

LRN_INSTANTIATE(half_t, f16)
LRN_INSTANTIATE(float, f32)
LRN_INSTANTIATE(double, f64)
