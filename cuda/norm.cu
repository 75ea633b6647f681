// Batch normalization's CUDA engine (caffe_syncbn/layers/norm/gpu.py). x, y, dy, dx are contiguous
// (N, C, HW) arrays of float16 (suffix _f16), float32 (_f32) or float64 (_f64); the layer's
// blobs (slope, bias, running mean/var, their diffs) are C values of the same type. Sums and
// products run in A = acc_t<T> (float32 for float16/float32, float64 for float64); every
// statistic that crosses replicas is float64, in the layout of the other engines (layers/norm/array.py):
//   forward packed buffer  [count, sum(x-K) (C), sum((x-K)^2) (C)],  K = running mean
//   backward packed buffer [sum(dy) (C), sum(dy*xhat) (C)]
// `params` is the per-channel A array [mean_hi, mean_lo, invstd, scale, bias] (5C) that the
// engine builds from the layer's statistics: mean = mean_hi + mean_lo (mean_lo keeps what
// rounding the mean to A lost), scale = slope*invstd, so xhat = ((x - mean_hi) - mean_lo)*invstd,
// y = xhat*slope + bias.
//
// Launch shapes (B = 256 threads per block):
//
// syncbn_local_stats_<t>(x, N, C, HW, splits, partial, pivot)
//   grid (splits, C), block B. Block (b, c) walks the b-th of `splits` equal slices of channel
//   c's N*HW values, with 16-byte vector loads when HW and x allow. Sums are taken about the
//   channel's first value p_c, so they carry no cancellation whatever the data's offset.
//   reads x; writes partial[(c*splits + b)*2 + {0, 1}] = slice sums of (x-p_c), (x-p_c)^2
//   (float64) and pivot[c] = p_c (float64). Needs 1 <= N*HW < 2^31 (an empty replica
//   launches nothing).
// syncbn_stats_finish_<t>(partial, splits, C, pivot, shift, count, out)
//   grid ceil(C/B), block B, a thread per channel: adds the channel's partials in fixed order
//   in float64, then moves them from p_c to K_c = shift[c] (shift null: they stay about p_c):
//   sum(x-K) = S1 + m*d, sum((x-K)^2) = S2 + 2*d*S1 + m*d^2, d = p_c - K_c, m = count.
//   writes out[0] = count, out[1 + c], out[1 + C + c] (the forward packed buffer).
// syncbn_normalize_<t>(x, y, xhat, params, C, HW, total)
//   1-D grid-stride over the total = N*C*HW values, B per block, vectorised when HW allows.
//   reads x, params; writes y = xhat*slope + bias, and xhat itself when the xhat pointer is
//   not null (kept for the backward of an in-place layer). y may be x.
// syncbn_backward_reduce_<t>(x, dy, params, x_is_xhat, N, C, HW, splits, partial)
//   grid (splits, C), block B, slices as local_stats. x is the input, or xhat itself when
//   x_is_xhat != 0. writes partial[(c*splits + b)*2 + {0, 1}] = slice sums of dy, dy*xhat.
// syncbn_grad_finish_<t>(partial, splits, C, out, dslope, dbias)
//   grid ceil(C/B), block B: out[c] = sum(dy), out[C + c] = sum(dy*xhat) (float64, fixed
//   order); adds them to dbias[c] and dslope[c] too where those are not null (the LOCAL
//   sums are the param gradients; see layers/norm/batch_norm.py).
// syncbn_backward_dx_<t>(x, dy, dx, params, x_is_xhat, sums, count, C, HW, total)
//   1-D grid-stride like normalize. With the global sums (the backward packed buffer) and the
//   global count m = count[0] (the forward packed buffer):
//   dx = scale * (dy - sum(dy)/m - xhat*sum(dy*xhat)/m); sums null: dx = scale*dy (running
//   statistics). dx may be dy.
//
// The chains of layers/norm/chain.py: BatchNorm/BN followed by Scale and ReLU (inference: one
// multiply-add per value; TRAIN: normalize-affine-ReLU and its backward, which keeps only the
// OUTPUT y). ReLU with negative_slope s: r(v) = v > 0 ? v : s*v (s = 0: Caffe's ReLU; its
// gradient at 0 is s). Launch shapes: 1-D grid-stride, B threads per block, grid =
// min(ceil(items/B), 32*SMs), except fused_bn_relu_backward_reduce: grid (splits, C), block B
// (syncbn_backward_reduce's).
//
// fused_affine_relu_<t>(x, a, b, C, HW, total, relu, negative_slope, y)
//   Inference BN + Scale (+ ReLU): a, b are C values of A, the folded per-channel scale and
//   shift (a = gamma*invstd, b = beta - mean*a). reads x; writes y = r(a[c]*x + b[c]), or
//   a[c]*x + b[c] when relu == 0. y may be x. total = N*C*HW.
// fused_bn_relu_forward_<t>(x, params, C, HW, total, negative_slope, y)
//   TRAIN: params is the engine's 5C array (above): [mean_hi, mean_lo, invstd, scale, bias];
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
#include "common.cuh"

#define SYNCBN_BLOCK 256

template <class T>
struct ChannelSlice {
    // Vector j of channel c: row n = j / row_len of the (n, c) rows, column (j % row_len)*width.
    const int C, c, width;
    const i64 HW;
    const unsigned row_len, begin, end;
    __device__ ChannelSlice(int N, int C_, i64 HW_, int splits, bool aligned)
        : C(C_), c(blockIdx.y), width(aligned && HW_ % (16 / sizeof(T)) == 0 ? 16 / sizeof(T) : 1),
          HW(HW_), row_len((unsigned)(HW_ / width)),
          begin((unsigned)((u64)N * row_len * blockIdx.x / splits)),
          end((unsigned)((u64)N * row_len * (blockIdx.x + 1) / splits)) {}
    __device__ i64 offset(unsigned j) const {
        const unsigned n = j / row_len;
        return ((i64)n * C + c) * HW + (i64)(j - n * row_len) * width;
    }
};

template <class T>
__device__ void write_partials(double* partial, int splits, acc_t<T> s1, acc_t<T> s2) {
    __shared__ acc_t<T> scratch[32];
    s1 = block_sum(s1, scratch);
    s2 = block_sum(s2, scratch);
    if (threadIdx.x == 0) {
        const i64 slot = ((i64)blockIdx.y * splits + blockIdx.x) * 2;
        partial[slot] = s1;
        partial[slot + 1] = s2;
    }
}

template <class T>
__device__ void local_stats(const T* __restrict__ x, int N, int C, i64 HW, int splits,
                            double* __restrict__ partial, double* __restrict__ pivot) {
    typedef acc_t<T> A;
    constexpr int V = 16 / sizeof(T);
    const ChannelSlice<T> s(N, C, HW, splits, aligned16(x));
    const A p = to_float(x[(i64)s.c * HW]);
    A s1 = 0, s2 = 0;
    if (s.width == V) {
        for (unsigned j = s.begin + threadIdx.x; j < s.end; j += blockDim.x) {
            A v[V];
            load_vec<T, V>(x + s.offset(j), v);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const A d = v[k] - p;
                s1 += d;
                s2 += d * d;
            }
        }
    } else {
        for (unsigned j = s.begin + threadIdx.x; j < s.end; j += blockDim.x) {
            const A d = to_float(x[s.offset(j)]) - p;
            s1 += d;
            s2 += d * d;
        }
    }
    write_partials<T>(partial, splits, s1, s2);
    if (threadIdx.x == 0 && blockIdx.x == 0) pivot[s.c] = p;
}

template <class T>
__device__ void stats_finish(const double* __restrict__ partial, int splits, int C,
                             const double* __restrict__ pivot, const T* __restrict__ shift,
                             double count, double* __restrict__ out) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c == 0) out[0] = count;
    if (c >= C) return;
    double s1 = 0, s2 = 0;
    for (int b = 0; b < splits; ++b) {
        s1 += partial[((i64)c * splits + b) * 2];
        s2 += partial[((i64)c * splits + b) * 2 + 1];
    }
    const double d = shift != nullptr ? pivot[c] - (double)to_float(shift[c]) : 0.0;
    out[1 + c] = s1 + count * d;
    out[1 + C + c] = s2 + 2.0 * d * s1 + count * d * d;
}

// The channel of element e of an (N, C, HW) array; I is 32-bit when the array allows.
template <class I>
__device__ __forceinline__ int channel_of(I e, I HW, I C) {
    return (int)((e / HW) % C);
}

// The 32-bit index paths step v += stride past total / width: below 2^31 values that
// sum stays under 2^32 for any grid, where just below 2^32 it would wrap.
constexpr i64 INDEX32_LIMIT = (i64)1 << 31;

template <class T, class I>
__device__ void normalize_loop(const T* x, T* y, T* xhat, const acc_t<T>* params, I C, I HW,
                               I total) {
    typedef acc_t<T> A;
    constexpr int V = 16 / sizeof(T);
    const I stride = (I)blockDim.x * gridDim.x;
    const I first = (I)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec = HW % V == 0 && aligned16(x) && aligned16(y) && (!xhat || aligned16(xhat));
    const I width = vec ? V : 1;
    for (I v = first; v < total / width; v += stride) {
        const I e = v * width;
        const int c = channel_of<I>(e, HW, C);
        const A hi = params[c], lo = params[C + c], inv = params[2 * C + c];
        const A slope_ = params[3 * C + c], b = params[4 * C + c];
        if (vec) {
            A val[V], nx[V];
            load_vec<T, V>(x + e, val);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                nx[k] = ((val[k] - hi) - lo) * inv;
                val[k] = ((val[k] - hi) - lo) * slope_ + b;
            }
            store_vec<T, V>(y + e, val);
            if (xhat) store_vec<T, V>(xhat + e, nx);
        } else {
            const A d = (to_float(x[e]) - hi) - lo;
            y[e] = from_acc<T>(d * slope_ + b);
            if (xhat) xhat[e] = from_acc<T>(d * inv);
        }
    }
}

template <class T>
__device__ void backward_reduce(const T* __restrict__ x, const T* __restrict__ dy,
                                const acc_t<T>* __restrict__ params, int x_is_xhat, int N, int C,
                                i64 HW, int splits, double* __restrict__ partial) {
    typedef acc_t<T> A;
    constexpr int V = 16 / sizeof(T);
    const ChannelSlice<T> s(N, C, HW, splits, aligned16(x) && aligned16(dy));
    const A hi = x_is_xhat ? A(0) : params[s.c], lo = x_is_xhat ? A(0) : params[C + s.c];
    const A inv = x_is_xhat ? A(1) : params[2 * C + s.c];
    A s1 = 0, s2 = 0;
    if (s.width == V) {
        for (unsigned j = s.begin + threadIdx.x; j < s.end; j += blockDim.x) {
            const i64 o = s.offset(j);
            A xv[V], gv[V];
            load_vec<T, V>(x + o, xv);
            load_vec<T, V>(dy + o, gv);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                s1 += gv[k];
                s2 += gv[k] * ((xv[k] - hi) - lo);
            }
        }
    } else {
        for (unsigned j = s.begin + threadIdx.x; j < s.end; j += blockDim.x) {
            const i64 o = s.offset(j);
            const A g = to_float(dy[o]);
            s1 += g;
            s2 += g * ((to_float(x[o]) - hi) - lo);
        }
    }
    write_partials<T>(partial, splits, s1, s2 * inv);
}

template <class T>
__device__ void grad_finish(const double* __restrict__ partial, int splits, int C,
                            double* __restrict__ out, T* __restrict__ dslope, T* __restrict__ dbias) {
    typedef acc_t<T> A;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    double s1 = 0, s2 = 0;
    for (int b = 0; b < splits; ++b) {
        s1 += partial[((i64)c * splits + b) * 2];
        s2 += partial[((i64)c * splits + b) * 2 + 1];
    }
    out[c] = s1;
    out[C + c] = s2;
    if (dbias) dbias[c] = from_acc<T>((A)((double)to_float(dbias[c]) + s1));
    if (dslope) dslope[c] = from_acc<T>((A)((double)to_float(dslope[c]) + s2));
}

template <class T, class I>
__device__ void backward_dx_loop(const T* x, const T* dy, T* dx, const acc_t<T>* params,
                                 int x_is_xhat, const double* sums, const double* count, I C,
                                 I HW, I total) {
    typedef acc_t<T> A;
    constexpr int V = 16 / sizeof(T);
    const double inv_m = sums ? 1.0 / (count[0] > 1.0 ? count[0] : 1.0) : 0.0;
    const I stride = (I)blockDim.x * gridDim.x;
    const I first = (I)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec = HW % V == 0 && aligned16(x) && aligned16(dy) && aligned16(dx);
    const I width = vec ? V : 1;
    for (I v = first; v < total / width; v += stride) {
        const I e = v * width;
        const int c = channel_of<I>(e, HW, C);
        const A hi = x_is_xhat ? A(0) : params[c], lo = x_is_xhat ? A(0) : params[C + c];
        const A inv = x_is_xhat ? A(1) : params[2 * C + c], scale = params[3 * C + c];
        const A mean_dy = sums ? (A)(sums[c] * inv_m) : A(0);
        const A k = sums ? (A)(sums[C + c] * inv_m) * inv : A(0);
        if (vec) {
            A xv[V], gv[V];
            load_vec<T, V>(x + e, xv);
            load_vec<T, V>(dy + e, gv);
#pragma unroll
            for (int j = 0; j < V; ++j) gv[j] = scale * (gv[j] - mean_dy - ((xv[j] - hi) - lo) * k);
            store_vec<T, V>(dx + e, gv);
        } else {
            dx[e] = from_acc<T>(scale * (to_float(dy[e]) - mean_dy - ((to_float(x[e]) - hi) - lo) * k));
        }
    }
}

#define SYNCBN_INSTANTIATE(T, SUFFIX)                                                               \
    extern "C" __global__ void __launch_bounds__(SYNCBN_BLOCK) syncbn_local_stats_##SUFFIX(         \
        const T* x, int N, int C, i64 HW, int splits, double* partial, double* pivot) {            \
        local_stats<T>(x, N, C, HW, splits, partial, pivot);                                       \
    }                                                                                              \
    extern "C" __global__ void syncbn_stats_finish_##SUFFIX(const double* partial, int splits,     \
                                                            int C, const double* pivot,            \
                                                            const T* shift, double count,          \
                                                            double* out) {                         \
        stats_finish<T>(partial, splits, C, pivot, shift, count, out);                             \
    }                                                                                              \
    extern "C" __global__ void syncbn_normalize_##SUFFIX(const T* x, T* y, T* xhat,                \
                                                         const acc_t<T>* params, i64 C, i64 HW,    \
                                                         i64 total) {                              \
        if (total < INDEX32_LIMIT)                                                             \
            normalize_loop<T, unsigned>(x, y, xhat, params, (unsigned)C, (unsigned)HW,             \
                                        (unsigned)total);                                          \
        else                                                                                       \
            normalize_loop<T, u64>(x, y, xhat, params, C, HW, total);                              \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(SYNCBN_BLOCK) syncbn_backward_reduce_##SUFFIX(     \
        const T* x, const T* dy, const acc_t<T>* params, int x_is_xhat, int N, int C, i64 HW,      \
        int splits, double* partial) {                                                             \
        backward_reduce<T>(x, dy, params, x_is_xhat, N, C, HW, splits, partial);                   \
    }                                                                                              \
    extern "C" __global__ void syncbn_grad_finish_##SUFFIX(const double* partial, int splits,      \
                                                           int C, double* out, T* dslope,          \
                                                           T* dbias) {                             \
        grad_finish<T>(partial, splits, C, out, dslope, dbias);                                    \
    }                                                                                              \
    extern "C" __global__ void syncbn_backward_dx_##SUFFIX(                                        \
        const T* x, const T* dy, T* dx, const acc_t<T>* params, int x_is_xhat,                     \
        const double* sums, const double* count, i64 C, i64 HW, i64 total) {                       \
        if (total < INDEX32_LIMIT)                                                             \
            backward_dx_loop<T, unsigned>(x, dy, dx, params, x_is_xhat, sums, count, (unsigned)C,  \
                                          (unsigned)HW, (unsigned)total);                          \
        else                                                                                       \
            backward_dx_loop<T, u64>(x, dy, dx, params, x_is_xhat, sums, count, C, HW, total);     \
    }

SYNCBN_INSTANTIATE(half_t, f16)
SYNCBN_INSTANTIATE(float, f32)
SYNCBN_INSTANTIATE(double, f64)

#define GRID_STRIDE(t, n)                                                                             \
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

#define NORM_CHAIN_INSTANTIATE(T, SUFFIX)                                                         \
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
    }

NORM_CHAIN_INSTANTIATE(half_t, f16)
NORM_CHAIN_INSTANTIATE(float, f32)
NORM_CHAIN_INSTANTIATE(double, f64)
