// SoftmaxWithLoss (caffe_syncbn/layers/loss/gpu.py). scores and prob are contiguous
// (outer, classes, inner) arrays; labels (outer, inner) hold class indices as floats, truncated
// to int as Caffe's static_cast<int> does. A position is valid unless its label equals
// ignore_label (when has_ignore != 0). _f16, _f32, _f64: the element type; the softmax runs in
// float32 (float16, float32) or float64, with the log clamped at FLT_MIN as in Caffe.
//
// Launch shapes: 1-D grid-stride, 256 threads per block, grid = min(ceil(items/256), 32*SMs).
//
// softmax_loss_forward_<t>(scores, labels, outer, classes, inner, has_ignore, ignore_label,
//                          prob, loss, valid)
//   a thread per position (o, i), reading its `classes` scores (coalesced along i).
//   writes prob (outer, classes, inner), loss[o*inner + i] = -log(max(prob[label], FLT_MIN))
//   (0 where ignored) and valid[o*inner + i] = 1 (counted), 0 (ignored) or -1 (a label out of
//   [0, classes): the caller raises). loss and valid are float32, or float64 for _f64: the
//   caller sums them (the per-position valid count is VALID normalization's count).
// softmax_loss_backward_<t>(prob, labels, outer, classes, inner, has_ignore, ignore_label,
//                           top_diff, normalizer, dx)
//   a thread per element: dx = (prob - [k == label]) * top_diff[0] / normalizer[0], 0 where
//   ignored; top_diff is the loss top's diff (the loss weight, times a float16 run's loss
//   scale, 65536 at first: past float16's range), and normalizer, both float64 device
//   scalars (the global count of VALID normalization stays on the device: no host read).
#include "common.cuh"

#define GRID_STRIDE(t, n) \
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < (n); t += (i64)blockDim.x * gridDim.x)

__device__ __forceinline__ float exp_acc(float v) { return expf(v); }
__device__ __forceinline__ double exp_acc(double v) { return exp(v); }
__device__ __forceinline__ float log_acc(float v) { return logf(v); }
__device__ __forceinline__ double log_acc(double v) { return log(v); }

// Caffe clamps probabilities at FLT_MIN (the smallest normal float) before the log.
#define FLT_MIN_VALUE 1.17549435082228750797e-38

template <class T>
__device__ void forward(const T* __restrict__ scores, const T* __restrict__ labels, int outer,
                        int classes, i64 inner, int has_ignore, int ignore_label,
                        T* __restrict__ prob, acc_t<T>* __restrict__ loss,
                        acc_t<T>* __restrict__ valid) {
    typedef acc_t<T> A;
    GRID_STRIDE(t, (i64)outer * inner) {
        const i64 o = t / inner, i = t - o * inner;
        const T* s = scores + o * classes * inner + i;
        T* p = prob + o * classes * inner + i;
        A top = to_float(s[0]);
        for (int k = 1; k < classes; ++k) {
            const A v = to_float(s[k * inner]);
            top = v > top ? v : top;
        }
        A sum = 0;
        for (int k = 0; k < classes; ++k) sum += exp_acc(to_float(s[k * inner]) - top);
        for (int k = 0; k < classes; ++k) p[k * inner] = from_acc<T>(exp_acc(to_float(s[k * inner]) - top) / sum);
        const int label = (int)to_float(labels[t]);
        if (has_ignore && label == ignore_label) {
            loss[t] = 0;
            valid[t] = 0;
        } else if (label < 0 || label >= classes) {
            loss[t] = 0;
            valid[t] = -1;
        } else {
            const A pl = to_float(p[label * inner]);
            loss[t] = -log_acc(pl > (A)FLT_MIN_VALUE ? pl : (A)FLT_MIN_VALUE);
            valid[t] = 1;
        }
    }
}

template <class T>
__device__ void backward(const T* __restrict__ prob, const T* __restrict__ labels, int outer,
                         int classes, i64 inner, int has_ignore, int ignore_label,
                         const double* __restrict__ top_diff,
                         const double* __restrict__ normalizer, T* __restrict__ dx) {
    typedef acc_t<T> A;
    const A scale = (A)(top_diff[0] / normalizer[0]);
    GRID_STRIDE(t, (i64)outer * classes * inner) {
        const i64 i = t % inner, o = t / ((i64)classes * inner);
        const int k = (int)((t / inner) % classes);
        const int label = (int)to_float(labels[o * inner + i]);
        const bool ignored = (has_ignore && label == ignore_label) || label < 0 || label >= classes;
        const A g = to_float(prob[t]) - (k == label ? A(1) : A(0));
        dx[t] = from_acc<T>(ignored ? A(0) : g * scale);
    }
}

#define SOFTMAX_LOSS_INSTANTIATE(T, SUFFIX)                                                     \
    extern "C" __global__ void softmax_loss_forward_##SUFFIX(                                   \
        const T* scores, const T* labels, int outer, int classes, i64 inner, int has_ignore,    \
        int ignore_label, T* prob, acc_t<T>* loss, acc_t<T>* valid) {                           \
        forward<T>(scores, labels, outer, classes, inner, has_ignore, ignore_label, prob, loss, \
                   valid);                                                                      \
    }                                                                                           \
    extern "C" __global__ void softmax_loss_backward_##SUFFIX(                                  \
        const T* prob, const T* labels, int outer, int classes, i64 inner, int has_ignore,      \
        int ignore_label, const double* top_diff, const double* normalizer, T* dx) {            \
        backward<T>(prob, labels, outer, classes, inner, has_ignore, ignore_label, top_diff,    \
                    normalizer, dx);                                                            \
    }

SOFTMAX_LOSS_INSTANTIATE(half_t, f16)
SOFTMAX_LOSS_INSTANTIATE(float, f32)
SOFTMAX_LOSS_INSTANTIATE(double, f64)
