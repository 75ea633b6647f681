// im2col / col2im of 2-D convolutions with pad, stride and dilation (caffe_syncbn/layers/conv/gpu.py).
// Layouts (contiguous): image x (N, C, H, W); columns col (N, C, KH, KW, OH, OW), the contract
// of layers/conv/array.py, so col.reshape(N, C*KH*KW, OH*OW) is the GEMM operand of each image.
// Output size: OH = (H + 2*PH - (DH*(KH-1) + 1)) / SH + 1, likewise OW (the caller passes them).
// _f16, _f32, _f64: the element type; sums run in float32 (float16, float32) or float64.
//
// Launch shapes: 1-D grid-stride, 256 threads per block, grid = min(ceil(items/256), 32*SMs).
//
// im2col_<t>(x, N, C, H, W, KH, KW, PH, PW, SH, SW, DH, DW, OH, OW, col)
//   a thread per (n, c, oh, ow): reads the KH*KW cells of its window (zero outside the image)
//   and writes col[n, c, kh, kw, oh, ow] for every kernel offset (coalesced along ow).
// col2im_<t>(col, N, C, H, W, KH, KW, PH, PW, SH, SW, DH, DW, OH, OW, x)
//   a thread per image cell (n, c, h, w): gathers, in a fixed order, every column entry whose
//   window covers the cell and writes their sum to x (no atomics: deterministic).
#include "common.cuh"

struct Geometry {
    int N, C, H, W, KH, KW, PH, PW, SH, SW, DH, DW, OH, OW;
};

template <class T>
__device__ void im2col(const T* __restrict__ x, Geometry g, T* __restrict__ col) {
    const i64 windows = (i64)g.N * g.C * g.OH * g.OW;
    const i64 plane = (i64)g.OH * g.OW;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < windows;
         t += (i64)blockDim.x * gridDim.x) {
        const int ow = (int)(t % g.OW), oh = (int)((t / g.OW) % g.OH);
        const i64 nc = t / plane;
        const T* image = x + nc * g.H * g.W;
        T* out = col + nc * g.KH * g.KW * plane + (i64)oh * g.OW + ow;
        const int h0 = oh * g.SH - g.PH, w0 = ow * g.SW - g.PW;
        for (int kh = 0; kh < g.KH; ++kh) {
            const int h = h0 + kh * g.DH;
            for (int kw = 0; kw < g.KW; ++kw) {
                const int w = w0 + kw * g.DW;
                const bool inside = h >= 0 && h < g.H && w >= 0 && w < g.W;
                *out = inside ? image[(i64)h * g.W + w] : from_acc<T>(acc_t<T>(0));
                out += plane;
            }
        }
    }
}

template <class T>
__device__ void col2im(const T* __restrict__ col, Geometry g, T* __restrict__ x) {
    typedef acc_t<T> A;
    const i64 cells = (i64)g.N * g.C * g.H * g.W;
    const i64 plane = (i64)g.OH * g.OW;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < cells;
         t += (i64)blockDim.x * gridDim.x) {
        const int w = (int)(t % g.W), h = (int)((t / g.W) % g.H);
        const i64 nc = t / ((i64)g.H * g.W);
        const T* columns = col + nc * g.KH * g.KW * plane;
        A sum = 0;
        for (int kh = 0; kh < g.KH; ++kh) {
            const int hs = h + g.PH - kh * g.DH;  // = oh*SH for the window that puts kh here
            if (hs < 0 || hs % g.SH != 0 || hs / g.SH >= g.OH) continue;
            for (int kw = 0; kw < g.KW; ++kw) {
                const int ws = w + g.PW - kw * g.DW;
                if (ws < 0 || ws % g.SW != 0 || ws / g.SW >= g.OW) continue;
                sum += to_float(columns[((i64)kh * g.KW + kw) * plane + (i64)(hs / g.SH) * g.OW + ws / g.SW]);
            }
        }
        x[t] = from_acc<T>(sum);
    }
}

#define IM2COL_INSTANTIATE(T, SUFFIX)                                                             \
    extern "C" __global__ void im2col_##SUFFIX(const T* x, int N, int C, int H, int W, int KH,    \
                                               int KW, int PH, int PW, int SH, int SW, int DH,    \
                                               int DW, int OH, int OW, T* col) {                  \
        im2col<T>(x, Geometry{N, C, H, W, KH, KW, PH, PW, SH, SW, DH, DW, OH, OW}, col);          \
    }                                                                                             \
    extern "C" __global__ void col2im_##SUFFIX(const T* col, int N, int C, int H, int W, int KH,  \
                                               int KW, int PH, int PW, int SH, int SW, int DH,    \
                                               int DW, int OH, int OW, T* x) {                    \
        col2im<T>(col, Geometry{N, C, H, W, KH, KW, PH, PW, SH, SW, DH, DW, OH, OW}, x);          \
    }

IM2COL_INSTANTIATE(half_t, f16)
IM2COL_INSTANTIATE(float, f32)
IM2COL_INSTANTIATE(double, f64)
