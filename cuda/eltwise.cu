// Eltwise SUM followed by ReLU as one pass, for the chains a net runs as one kernel
// (caffe_syncbn/layers/eltwise/gpu.py), and the ReLU's gradient taken from its output, which
// batch normalization's chains use too (layers/norm/gpu.py). Arrays are contiguous and flat;
// _f16, _f32, _f64: the element type, arithmetic in A = acc_t<T> (float32 for
// float16/float32, float64 for float64). ReLU with negative_slope s: r(v) = v > 0 ? v : s*v
// (s = 0: Caffe's ReLU; its gradient at 0 is s).
//
// Launch shapes: 1-D grid-stride, 256 threads per block, grid = min(ceil(items/256), 32*SMs).
//
// fused_eltwise_sum_relu_<t>(a, b, coeff_a, coeff_b, n, negative_slope, y)
//   reads a, b; writes y = r(coeff_a*a + coeff_b*b). y may be a or b.
// fused_eltwise_sum_relu_backward_<t>(y, dy, coeff, n, negative_slope, dx)
//   reads y, dy; writes dx = coeff * (y > 0 ? dy : s*dy) (each input's gradient; dx may be dy).
#include "common.cuh"

#define GRID_STRIDE(t, n)                                                                             \
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < (n); t += (i64)blockDim.x * gridDim.x)

template <class A>
__device__ __forceinline__ A relu(A v, A slope) { return v > A(0) ? v : v * slope; }

template <class T>
__device__ void eltwise_sum_relu(const T* a, const T* b, double coeff_a, double coeff_b, i64 n,
                                 double negative_slope, T* y) {
    typedef acc_t<T> A;
    GRID_STRIDE(t, n) {
        const A v = (A)coeff_a * to_float(a[t]) + (A)coeff_b * to_float(b[t]);
        y[t] = from_acc<T>(relu(v, (A)negative_slope));
    }
}

template <class T>
__device__ void eltwise_sum_relu_backward(const T* y, const T* dy, double coeff, i64 n,
                                          double negative_slope, T* dx) {
    typedef acc_t<T> A;
    GRID_STRIDE(t, n) {
        const A g = to_float(dy[t]);
        dx[t] = from_acc<T>((A)coeff * (to_float(y[t]) > A(0) ? g : g * (A)negative_slope));
    }
}

#define ELTWISE_INSTANTIATE(T, SUFFIX)                                                            \
    extern "C" __global__ void fused_eltwise_sum_relu_##SUFFIX(const T* a, const T* b,            \
                                                               double coeff_a, double coeff_b,    \
                                                               i64 n, double slope, T* y) {       \
        eltwise_sum_relu<T>(a, b, coeff_a, coeff_b, n, slope, y);                                 \
    }                                                                                             \
    extern "C" __global__ void fused_eltwise_sum_relu_backward_##SUFFIX(                          \
        const T* y, const T* dy, double coeff, i64 n, double slope, T* dx) {                      \
        eltwise_sum_relu_backward<T>(y, dy, coeff, n, slope, dx);                                 \
    }

ELTWISE_INSTANTIATE(half_t, f16)
ELTWISE_INSTANTIATE(float, f32)
ELTWISE_INSTANTIATE(double, f64)
