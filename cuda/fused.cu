// Fused elementwise passes for layer chains a net can run as one kernel: BatchNorm/BN followed
// by Scale and ReLU (inference: one multiply-add per value; TRAIN: normalize-affine-ReLU and
// its backward, which keeps only the OUTPUT y), and Eltwise SUM followed by ReLU. Arrays are
// contiguous (N, C, HW) or flat; _f16, _f32, _f64: the element type, arithmetic in
// A = acc_t<T> (float32 for float16/float32, float64 for float64). ReLU with
// negative_slope s: r(v) = v > 0 ? v : s*v (s = 0: Caffe's ReLU; its gradient at 0 is s).
//
// Launch shapes: 1-D grid-stride, 256 threads per block, grid = min(ceil(items/256), 32*SMs),
// except fused_bn_relu_backward_reduce: grid (splits, C), 256 threads (syncbn_backward_reduce's).
//
// fused_affine_relu_<t>(x, a, b, C, HW, total, relu, negative_slope, y)
//   Inference BN + Scale (+ ReLU): a, b are C values of A, the folded per-channel scale and
//   shift (a = gamma*invstd, b = beta - mean*a). reads x; writes y = r(a[c]*x + b[c]), or
//   a[c]*x + b[c] when relu == 0. y may be x. total = N*C*HW.
// fused_bn_relu_forward_<t>(x, params, C, HW, total, negative_slope, y)
//   TRAIN: params is syncbn_prepare's 5C array [mean_hi, mean_lo, invstd, gamma*invstd, beta];
//   reads x; writes y = r(xhat*gamma + beta), xhat = ((x - mean_hi) - mean_lo)*invstd. y may be x.
// fused_bn_relu_backward_reduce_<t>(y, dy, gamma, beta, negative_slope, N, C, HW, splits, partial)
//   recomputes from the output: the pre-activation p = y > 0 ? y : y/s (0 when s == 0),
//   x_hat = (p - beta)/gamma (gamma != 0 on every channel: the caller checks), the gradient
//   through the ReLU g = y > 0 ? dy : s*dy. Block (b, c) sums its b-th of `splits` equal slices
//   of channel c's N*HW values; writes partial[(c*splits + b)*2 + {0, 1}] = sum(g),
//   sum(g*x_hat) (float64), syncbn_grad_finish's input.
// fused_bn_relu_backward_dx_<t>(y, dy, gamma, beta, negative_slope, params, sums, count, C, HW,
//                               total, dx)
//   with the global sums [sum(g) (C), sum(g*x_hat) (C)] and count m = count[0]:
//   dx = gamma*invstd * (g - sum(g)/m - x_hat*sum(g*x_hat)/m). dx may be dy.
// fused_eltwise_sum_relu_<t>(a, b, coeff_a, coeff_b, n, negative_slope, y)
//   reads a, b; writes y = r(coeff_a*a + coeff_b*b). y may be a or b.
// fused_eltwise_sum_relu_backward_<t>(y, dy, coeff, n, negative_slope, dx)
//   reads y, dy; writes dx = coeff * (y > 0 ? dy : s*dy) (each input's gradient; dx may be dy).
#include "common.cuh"

#define GRID_STRIDE(t, n) \
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < (n); t += (i64)blockDim.x * gridDim.x)

template <class A>
__device__ __forceinline__ A relu(A v, A slope) { return v > A(0) ? v : v * slope; }

template <class T>
__device__ void affine_relu(const T* x, const acc_t<T>* a, const acc_t<T>* b, i64 C, i64 HW,
                            i64 total, int use_relu, double negative_slope, T* y) {
    typedef acc_t<T> A;
    GRID_STRIDE(t, total) {
        const i64 c = t / HW % C;
        const A v = a[c] * to_float(x[t]) + b[c];
        y[t] = from_acc<T>(use_relu ? relu(v, (A)negative_slope) : v);
    }
}

template <class T>
__device__ void bn_relu_forward(const T* x, const acc_t<T>* params, i64 C, i64 HW, i64 total,
                                double negative_slope, T* y) {
    typedef acc_t<T> A;
    GRID_STRIDE(t, total) {
        const i64 c = t / HW % C;
        const A d = (to_float(x[t]) - params[c]) - params[C + c];
        y[t] = from_acc<T>(relu(d * params[3 * C + c] + params[4 * C + c], (A)negative_slope));
    }
}

// The gradient through the ReLU and the normalized input, both recovered from the output.
template <class T>
struct FromOutput {
    acc_t<T> g, xhat;
    __device__ FromOutput(T y_, T dy_, acc_t<T> gamma, acc_t<T> beta, acc_t<T> slope) {
        typedef acc_t<T> A;
        const A y = to_float(y_), dy = to_float(dy_);
        const bool on = y > A(0);
        g = on ? dy : dy * slope;
        const A pre = on ? y : (slope != A(0) ? y / slope : A(0));
        xhat = (pre - beta) / gamma;
    }
};

template <class T>
__device__ void bn_relu_backward_reduce(const T* __restrict__ y, const T* __restrict__ dy,
                                        const T* __restrict__ gamma, const T* __restrict__ beta,
                                        double negative_slope, int N, int C, i64 HW, int splits,
                                        double* __restrict__ partial) {
    typedef acc_t<T> A;
    __shared__ A scratch[32];
    const int c = blockIdx.y;
    const i64 count = (i64)N * HW;
    const i64 begin = count * blockIdx.x / splits, end = count * (blockIdx.x + 1) / splits;
    const A gm = to_float(gamma[c]), bt = to_float(beta[c]), slope = (A)negative_slope;
    A s1 = 0, s2 = 0;
    for (i64 j = begin + threadIdx.x; j < end; j += blockDim.x) {
        const i64 n = j / HW, o = (n * C + c) * HW + (j - n * HW);
        const FromOutput<T> r(y[o], dy[o], gm, bt, slope);
        s1 += r.g;
        s2 += r.g * r.xhat;
    }
    s1 = block_sum(s1, scratch);
    s2 = block_sum(s2, scratch);
    if (threadIdx.x == 0) {
        const i64 slot = ((i64)c * splits + blockIdx.x) * 2;
        partial[slot] = s1;
        partial[slot + 1] = s2;
    }
}

template <class T>
__device__ void bn_relu_backward_dx(const T* y, const T* dy, const T* gamma, const T* beta,
                                    double negative_slope, const acc_t<T>* params,
                                    const double* sums, const double* count, i64 C, i64 HW,
                                    i64 total, T* dx) {
    typedef acc_t<T> A;
    const double inv_m = 1.0 / (count[0] > 1.0 ? count[0] : 1.0);
    GRID_STRIDE(t, total) {
        const i64 c = t / HW % C;
        const FromOutput<T> r(y[t], dy[t], to_float(gamma[c]), to_float(beta[c]),
                              (A)negative_slope);
        const A mean_g = (A)(sums[c] * inv_m), k = (A)(sums[C + c] * inv_m);
        dx[t] = from_acc<T>(params[3 * C + c] * (r.g - mean_g - r.xhat * k));
    }
}

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

#define FUSED_INSTANTIATE(T, SUFFIX)                                                              \
    extern "C" __global__ void fused_affine_relu_##SUFFIX(const T* x, const acc_t<T>* a,          \
                                                          const acc_t<T>* b, i64 C, i64 HW,       \
                                                          i64 total, int use_relu, double slope,  \
                                                          T* y) {                                 \
        affine_relu<T>(x, a, b, C, HW, total, use_relu, slope, y);                                \
    }                                                                                             \
    extern "C" __global__ void fused_bn_relu_forward_##SUFFIX(const T* x, const acc_t<T>* params, \
                                                              i64 C, i64 HW, i64 total,           \
                                                              double slope, T* y) {               \
        bn_relu_forward<T>(x, params, C, HW, total, slope, y);                                    \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) fused_bn_relu_backward_reduce_##SUFFIX(     \
        const T* y, const T* dy, const T* gamma, const T* beta, double slope, int N, int C,       \
        i64 HW, int splits, double* partial) {                                                    \
        bn_relu_backward_reduce<T>(y, dy, gamma, beta, slope, N, C, HW, splits, partial);         \
    }                                                                                             \
    extern "C" __global__ void fused_bn_relu_backward_dx_##SUFFIX(                                \
        const T* y, const T* dy, const T* gamma, const T* beta, double slope,                     \
        const acc_t<T>* params, const double* sums, const double* count, i64 C, i64 HW,           \
        i64 total, T* dx) {                                                                       \
        bn_relu_backward_dx<T>(y, dy, gamma, beta, slope, params, sums, count, C, HW, total, dx); \
    }                                                                                             \
    extern "C" __global__ void fused_eltwise_sum_relu_##SUFFIX(const T* a, const T* b,            \
                                                               double coeff_a, double coeff_b,    \
                                                               i64 n, double slope, T* y) {       \
        eltwise_sum_relu<T>(a, b, coeff_a, coeff_b, n, slope, y);                                 \
    }                                                                                             \
    extern "C" __global__ void fused_eltwise_sum_relu_backward_##SUFFIX(                          \
        const T* y, const T* dy, double coeff, i64 n, double slope, T* dx) {                      \
        eltwise_sum_relu_backward<T>(y, dy, coeff, n, slope, dx);                                 \
    }

FUSED_INSTANTIATE(half_t, f16)
FUSED_INSTANTIATE(float, f32)
FUSED_INSTANTIATE(double, f64)
