// MAX and AVE pooling of (N, C, H, W) blobs, forward and backward, with Caffe's rules
// (caffe_syncbn/layers/pooling/gpu.py; the output size OH, OW is computed by the caller,
// layers/pooling/layers.py: ceil rounding, and with padding the last window may not start in it).
// A window (oh, ow) covers rows [oh*SH - PH, oh*SH - PH + KH) and columns likewise.
//   MAX ignores the padding; the first maximum in row-major order wins; index = h*W + w.
//   AVE divides by the window clipped to [-PH, H + PH) x [-PW, W + PW): padded cells count,
//   the overhang of a ceil-rounded last window does not.
// _f16, _f32, _f64: the element type; sums run in float32 (float16, float32) or float64.
// Offsets inside a plane are int: H*W and OH*OW stay below 2^31 (MAX's index is int32 too);
// the counts over all planes (NC*H*W, NC*OH*OW) are 64-bit.
//
// Launch shapes: 1-D grid-stride, 256 threads per block, grid = min(ceil(items/256), 32*SMs).
//
// pool_max_forward_<t>(x, NC, H, W, OH, OW, KH, KW, SH, SW, PH, PW, y, index)
//   a thread per output: reads its window of x; writes y and index (int32, h*W + w).
// pool_max_backward_<t>(dy, index, NC, H, W, OH, OW, KH, KW, SH, SW, PH, PW, dx)
//   a thread per input cell: sums dy of the windows that cover it and chose it (fixed order).
// pool_ave_forward_<t>(x, NC, H, W, OH, OW, KH, KW, SH, SW, PH, PW, y)
//   a thread per output: y = sum of the window / Caffe's divisor.
// pool_ave_backward_<t>(dy, NC, H, W, OH, OW, KH, KW, SH, SW, PH, PW, dx)
//   a thread per input cell: dx = sum over the windows covering it of dy / divisor.
#include "common.cuh"

struct Pool {
    int NC, H, W, OH, OW, KH, KW, SH, SW, PH, PW;
};

#define GRID_STRIDE(t, n) \
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < (n); t += (i64)blockDim.x * gridDim.x)

// The range [first, last) of window indices along one axis whose window covers padded cell p.
__device__ __forceinline__ void covering(int p, int k, int s, int out, int* first, int* last) {
    *first = p < k ? 0 : (p - k) / s + 1;
    const int end = p / s + 1;
    *last = end < out ? end : out;
}

template <class T>
__device__ void max_forward(const T* __restrict__ x, Pool g, T* __restrict__ y,
                            int* __restrict__ index) {
    GRID_STRIDE(t, (i64)g.NC * g.OH * g.OW) {
        const int ow = (int)(t % g.OW), oh = (int)((t / g.OW) % g.OH);
        const T* plane = x + (t / ((i64)g.OH * g.OW)) * g.H * g.W;
        int h0 = oh * g.SH - g.PH, w0 = ow * g.SW - g.PW;
        const int h1 = min(h0 + g.KH, g.H), w1 = min(w0 + g.KW, g.W);
        h0 = max(h0, 0);
        w0 = max(w0, 0);
        int best = h0 * g.W + w0;
        acc_t<T> best_value = to_float(plane[best]);
        for (int h = h0; h < h1; ++h)
            for (int w = w0; w < w1; ++w) {
                const acc_t<T> v = to_float(plane[h * g.W + w]);
                if (v > best_value) {
                    best_value = v;
                    best = h * g.W + w;
                }
            }
        y[t] = from_acc<T>(best_value);
        index[t] = best;
    }
}

template <class T>
__device__ void max_backward(const T* __restrict__ dy, const int* __restrict__ index, Pool g,
                             T* __restrict__ dx) {
    GRID_STRIDE(t, (i64)g.NC * g.H * g.W) {
        const int w = (int)(t % g.W), h = (int)((t / g.W) % g.H);
        const i64 offset = (t / ((i64)g.H * g.W)) * g.OH * g.OW;
        int oh0, oh1, ow0, ow1;
        covering(h + g.PH, g.KH, g.SH, g.OH, &oh0, &oh1);
        covering(w + g.PW, g.KW, g.SW, g.OW, &ow0, &ow1);
        acc_t<T> sum = 0;
        for (int oh = oh0; oh < oh1; ++oh)
            for (int ow = ow0; ow < ow1; ++ow) {
                const i64 o = offset + (i64)oh * g.OW + ow;
                if (index[o] == h * g.W + w) sum += to_float(dy[o]);
            }
        dx[t] = from_acc<T>(sum);
    }
}

// Caffe's AVE divisor of window (oh, ow): its area clipped to the padded image.
__device__ __forceinline__ int ave_divisor(const Pool& g, int oh, int ow) {
    const int h0 = oh * g.SH - g.PH, w0 = ow * g.SW - g.PW;
    const int h1 = min(h0 + g.KH, g.H + g.PH), w1 = min(w0 + g.KW, g.W + g.PW);
    return (h1 - h0) * (w1 - w0);
}

template <class T>
__device__ void ave_forward(const T* __restrict__ x, Pool g, T* __restrict__ y) {
    GRID_STRIDE(t, (i64)g.NC * g.OH * g.OW) {
        const int ow = (int)(t % g.OW), oh = (int)((t / g.OW) % g.OH);
        const T* plane = x + (t / ((i64)g.OH * g.OW)) * g.H * g.W;
        const int h0 = max(oh * g.SH - g.PH, 0), w0 = max(ow * g.SW - g.PW, 0);
        const int h1 = min(oh * g.SH - g.PH + g.KH, g.H), w1 = min(ow * g.SW - g.PW + g.KW, g.W);
        acc_t<T> sum = 0;
        for (int h = h0; h < h1; ++h)
            for (int w = w0; w < w1; ++w) sum += to_float(plane[h * g.W + w]);
        y[t] = from_acc<T>(sum / ave_divisor(g, oh, ow));
    }
}

template <class T>
__device__ void ave_backward(const T* __restrict__ dy, Pool g, T* __restrict__ dx) {
    GRID_STRIDE(t, (i64)g.NC * g.H * g.W) {
        const int w = (int)(t % g.W), h = (int)((t / g.W) % g.H);
        const T* grad = dy + (t / ((i64)g.H * g.W)) * g.OH * g.OW;
        int oh0, oh1, ow0, ow1;
        covering(h + g.PH, g.KH, g.SH, g.OH, &oh0, &oh1);
        covering(w + g.PW, g.KW, g.SW, g.OW, &ow0, &ow1);
        acc_t<T> sum = 0;
        for (int oh = oh0; oh < oh1; ++oh)
            for (int ow = ow0; ow < ow1; ++ow)
                sum += to_float(grad[oh * g.OW + ow]) / ave_divisor(g, oh, ow);
        dx[t] = from_acc<T>(sum);
    }
}

#define POOL_ARGS int NC, int H, int W, int OH, int OW, int KH, int KW, int SH, int SW, int PH, int PW
#define POOL_GEOMETRY Pool{NC, H, W, OH, OW, KH, KW, SH, SW, PH, PW}
#define POOL_INSTANTIATE(T, SUFFIX)                                                             \
    extern "C" __global__ void pool_max_forward_##SUFFIX(const T* x, POOL_ARGS, T* y,           \
                                                         int* index) {                          \
        max_forward<T>(x, POOL_GEOMETRY, y, index);                                             \
    }                                                                                           \
    extern "C" __global__ void pool_max_backward_##SUFFIX(const T* dy, const int* index,        \
                                                          POOL_ARGS, T* dx) {                   \
        max_backward<T>(dy, index, POOL_GEOMETRY, dx);                                          \
    }                                                                                           \
    extern "C" __global__ void pool_ave_forward_##SUFFIX(const T* x, POOL_ARGS, T* y) {         \
        ave_forward<T>(x, POOL_GEOMETRY, y);                                                    \
    }                                                                                           \
    extern "C" __global__ void pool_ave_backward_##SUFFIX(const T* dy, POOL_ARGS, T* dx) {      \
        ave_backward<T>(dy, POOL_GEOMETRY, dx);                                                 \
    }

POOL_INSTANTIATE(half_t, f16)
POOL_INSTANTIATE(float, f32)
POOL_INSTANTIATE(double, f64)
