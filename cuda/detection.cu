// The array passes of the SSD fork's detection layers (caffe_syncbn/layers/detection/gpu.py):
// decoding every prior's location offsets into boxes, and the Jaccard overlap (IoU) matrix of
// two box sets. Boxes are (xmin, ymin, xmax, ymax) rows of 4 values. _f16, _f32, _f64: the
// storage type T of the inputs; arithmetic and outputs in A = acc_t<T> (float32 for
// float16/float32, float64 for float64). The rules are boxes.py's (docs/detection.md).
//
// What stays on the host, and why: greedy NMS (a candidate is kept only when it overlaps no box
// kept before it, so each step waits for the previous one) and the bipartite matching of
// MultiBoxLoss (each pick removes a row and a column that the next pick must not take). Both
// are sequential over at most a few hundred candidates; they read this file's outputs.
//
// Launch shapes: 1-D grid-stride, 256 threads per block, grid = min(ceil(items/256), 32*SMs).
// No vector loads: a thread reads its 8 (jaccard) or 12 (decode_boxes) values one by one.
// Item indices are 64-bit: num*P*L boxes and na*nb pairs may pass 2^31 (num, P, L: ints).
//
// decode_boxes_<t>(loc, prior, num, P, L, code_type, variance_encoded_in_target, boxes)
//   loc (num, P, L, 4) offsets: L = 1 shares one box per prior over the classes
//   (share_location), L = classes gives one per class; prior (2, P, 4): PriorBox's top, the
//   boxes then their variances. A thread per (n, p, l): reads loc[n, p, l, :], prior[0, p, :],
//   prior[1, p, :]; writes boxes[n, p, l, :]. With o = the offsets, times the variances unless
//   variance_encoded_in_target, and the prior's width w and height h:
//     code_type 1 CORNER       prior + o
//     code_type 3 CORNER_SIZE  prior + o * (w, h, w, h)
//     code_type 2 CENTER_SIZE  centre (o0*w + cx, o1*h + cy), half sizes exp(o2)*w/2,
//                              exp(o3)*h/2 (cx, cy: the prior's centre)
//   The caller passes one of the three.
// jaccard_<t>(a, na, b, nb, iou)
//   a (na, 4), b (nb, 4); a thread per pair (i, j): reads a[i, :], b[j, :]; writes
//   iou[i*nb + j] = intersection / union, 0 unless the intersection has a positive width and
//   height. A box with xmax < xmin or ymax < ymin has size 0 in the union.
#include "common.cuh"

#define GRID_STRIDE(t, n) \
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < (n); t += (i64)blockDim.x * gridDim.x)

enum { CODE_CORNER = 1, CODE_CORNER_SIZE = 3 };  // and CENTER_SIZE (2): the last branch

// expf for float: the C library's exp would compute a float32 offset in float64
__device__ __forceinline__ float exp_acc(float v) { return expf(v); }
__device__ __forceinline__ double exp_acc(double v) { return exp(v); }

template <class T>
__device__ void decode_boxes(const T* __restrict__ loc, const T* __restrict__ prior, int num,
                             int P, int L, int code_type, int variance_encoded_in_target,
                             acc_t<T>* __restrict__ boxes) {
    typedef acc_t<T> A;
    GRID_STRIDE(t, (i64)num * P * L) {
        const i64 p = t / L % P;
        const T* in = loc + t * 4;
        const T* box = prior + p * 4;
        const T* var = prior + (P + p) * 4;       // p is an i64: so is the sum
        A o[4], q[4];
        for (int k = 0; k < 4; ++k) {
            o[k] = variance_encoded_in_target ? to_float(in[k]) : to_float(in[k]) * to_float(var[k]);
            q[k] = to_float(box[k]);
        }
        const A w = q[2] - q[0], h = q[3] - q[1];
        A* out = boxes + t * 4;
        if (code_type == CODE_CORNER) {
            for (int k = 0; k < 4; ++k) out[k] = q[k] + o[k];
        } else if (code_type == CODE_CORNER_SIZE) {
            for (int k = 0; k < 4; ++k) out[k] = q[k] + o[k] * (k % 2 ? h : w);
        } else {
            const A cx = o[0] * w + (q[0] + q[2]) / A(2), cy = o[1] * h + (q[1] + q[3]) / A(2);
            const A half_w = exp_acc(o[2]) * w / A(2), half_h = exp_acc(o[3]) * h / A(2);
            out[0] = cx - half_w;
            out[1] = cy - half_h;
            out[2] = cx + half_w;
            out[3] = cy + half_h;
        }
    }
}

template <class A>
__device__ __forceinline__ A box_size(A xmin, A ymin, A xmax, A ymax) {
    const A w = xmax - xmin, h = ymax - ymin;
    return w < A(0) || h < A(0) ? A(0) : w * h;
}

template <class T>
__device__ void jaccard(const T* __restrict__ a, i64 na, const T* __restrict__ b, i64 nb,
                        acc_t<T>* __restrict__ iou) {
    typedef acc_t<T> A;
    GRID_STRIDE(t, na * nb) {
        const T* u = a + t / nb * 4;
        const T* v = b + t % nb * 4;
        const A u0 = to_float(u[0]), u1 = to_float(u[1]), u2 = to_float(u[2]), u3 = to_float(u[3]);
        const A v0 = to_float(v[0]), v1 = to_float(v[1]), v2 = to_float(v[2]), v3 = to_float(v[3]);
        const A w = (u2 < v2 ? u2 : v2) - (u0 > v0 ? u0 : v0);
        const A h = (u3 < v3 ? u3 : v3) - (u1 > v1 ? u1 : v1);
        if (w > A(0) && h > A(0)) {
            const A inter = w * h;
            iou[t] = inter / (box_size(u0, u1, u2, u3) + box_size(v0, v1, v2, v3) - inter);
        } else {
            iou[t] = A(0);
        }
    }
}

#define DETECTION_INSTANTIATE(T, SUFFIX)                                                          \
    extern "C" __global__ void decode_boxes_##SUFFIX(const T* loc, const T* prior, int num,     \
                                                     int P, int L, int code_type,                \
                                                     int variance_encoded_in_target,             \
                                                     acc_t<T>* boxes) {                          \
        decode_boxes<T>(loc, prior, num, P, L, code_type, variance_encoded_in_target, boxes);   \
    }                                                                                             \
    extern "C" __global__ void jaccard_##SUFFIX(const T* a, i64 na, const T* b, i64 nb,          \
                                                acc_t<T>* iou) {                                 \
        jaccard<T>(a, na, b, nb, iou);                                                            \
    }

DETECTION_INSTANTIATE(half_t, f16)
DETECTION_INSTANTIATE(float, f32)
DETECTION_INSTANTIATE(double, f64)
