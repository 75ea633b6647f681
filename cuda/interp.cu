// Interp of the PSPNet fork (caffe_syncbn/layers/interp/gpu.py): crop, then bilinear resize with
// aligned corners. x is (NC, H, W); the cropped input is x[:, B:B+IH, B:B+IW] (B = crop, the
// fork's -pad_beg); y is (NC, OH, OW). Sampling follows the fork in float32: ratio r =
// (IH-1)/(OH-1) (0 when OH == 1), src = r*o, i0 = (int)src, lambda = src - i0,
// i1 = min(i0 + 1, IH - 1); columns likewise. _f32, _f64: the element type (no float16:
// backward adds with atomics).
//
// Launch shapes: 1-D grid-stride, 256 threads per block, grid = min(ceil(items/256), 32*SMs).
//
// interp_forward_<t>(x, NC, H, W, B, IH, IW, OH, OW, y)
//   a thread per output: reads its 4 source cells; writes
//   y = h0*(w0*x[i0,j0] + w1*x[i0,j1]) + h1*(w0*x[i1,j0] + w1*x[i1,j1]) (the fork's order).
// interp_backward_<t>(dy, NC, H, W, B, IH, IW, OH, OW, dx)
//   a thread per output: atomically adds its 4 weighted dy to dx, which the caller zeroed
//   (the exact adjoint; cropped-away cells keep 0). The order of the additions varies.
#include "common.cuh"

#define GRID_STRIDE(t, n) \
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < (n); t += (i64)blockDim.x * gridDim.x)

struct Tap {
    int first, second;
    float weight_second;
};

__device__ __forceinline__ Tap tap(int o, int in_size, int out_size) {
    const float ratio = out_size > 1 ? (float)(in_size - 1) / (float)(out_size - 1) : 0.0f;
    const float src = ratio * (float)o;
    Tap t;
    t.first = (int)src;
    t.second = t.first + 1 < in_size ? t.first + 1 : in_size - 1;
    t.weight_second = src - (float)t.first;
    return t;
}

template <class T>
__device__ void forward(const T* __restrict__ x, int NC, int H, int W, int B, int IH, int IW,
                        int OH, int OW, T* __restrict__ y) {
    typedef acc_t<T> A;
    GRID_STRIDE(t, (i64)NC * OH * OW) {
        const int ow = (int)(t % OW), oh = (int)((t / OW) % OH);
        const T* plane = x + (t / ((i64)OH * OW)) * H * W + (i64)B * W + B;
        const Tap th = tap(oh, IH, OH), tw = tap(ow, IW, OW);
        const A h1 = th.weight_second, h0 = A(1) - h1, w1 = tw.weight_second, w0 = A(1) - w1;
        const T* r0 = plane + (i64)th.first * W;
        const T* r1 = plane + (i64)th.second * W;
        y[t] = h0 * (w0 * r0[tw.first] + w1 * r0[tw.second]) +
               h1 * (w0 * r1[tw.first] + w1 * r1[tw.second]);
    }
}

template <class T>
__device__ void backward(const T* __restrict__ dy, int NC, int H, int W, int B, int IH, int IW,
                         int OH, int OW, T* __restrict__ dx) {
    typedef acc_t<T> A;
    GRID_STRIDE(t, (i64)NC * OH * OW) {
        const int ow = (int)(t % OW), oh = (int)((t / OW) % OH);
        T* plane = dx + (t / ((i64)OH * OW)) * H * W + (i64)B * W + B;
        const Tap th = tap(oh, IH, OH), tw = tap(ow, IW, OW);
        const A h1 = th.weight_second, h0 = A(1) - h1, w1 = tw.weight_second, w0 = A(1) - w1;
        const A g = dy[t];
        T* r0 = plane + (i64)th.first * W;
        T* r1 = plane + (i64)th.second * W;
        atomicAdd(r0 + tw.first, (T)(h0 * w0 * g));
        atomicAdd(r0 + tw.second, (T)(h0 * w1 * g));
        atomicAdd(r1 + tw.first, (T)(h1 * w0 * g));
        atomicAdd(r1 + tw.second, (T)(h1 * w1 * g));
    }
}

#define INTERP_INSTANTIATE(T, SUFFIX)                                                           \
    extern "C" __global__ void interp_forward_##SUFFIX(const T* x, int NC, int H, int W, int B, \
                                                       int IH, int IW, int OH, int OW, T* y) {  \
        forward<T>(x, NC, H, W, B, IH, IW, OH, OW, y);                                          \
    }                                                                                           \
    extern "C" __global__ void interp_backward_##SUFFIX(const T* dy, int NC, int H, int W,      \
                                                        int B, int IH, int IW, int OH, int OW,  \
                                                        T* dx) {                                \
        backward<T>(dy, NC, H, W, B, IH, IW, OH, OW, dx);                                       \
    }

INTERP_INSTANTIATE(float, f32)
INTERP_INSTANTIATE(double, f64)
