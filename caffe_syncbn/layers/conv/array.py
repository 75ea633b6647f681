"""Convolution's array engine, which runs on numpy and CuPy alike: im2col + GEMM for N-D
convolutions and their adjoints with pad, stride, dilation and groups.

Column layout (the contract the GPU kernels must keep):  ``(N, C, *kernel, *out)``,
so that ``col.reshape(N, C * prod(kernel), prod(out))`` is the matrix that one
convolution GEMM per image multiplies, with rows ordered (channel, kernel offsets) as
in Caffe (this is also the channel order of the Im2col layer's top).

``im2col`` is one strided view over the zero-padded image, copied once; ``col2im`` is
its adjoint (overlapping windows add up), a loop over the kernel offsets. The columns are
laid out ``(N, G, C/G * K, P)`` (image, group, channel-and-kernel-offset, output position)
for the GEMMs and the weights ``(G, O/G, C/G * K)``; 1x1 stride-1 unpadded kernels use the
image itself as its columns.

The engine's passes, which every engine of the family has (host.py, gpu.py):
``forward(layer, x, y3)``: ``y3`` (N, O, P) from ``x`` (N, C, *spatial), bias included;
``backward(layer, x, dy3, dx, weight_grad)``: ``dx`` (like x, or None) written and the
weight gradient added to ``weight_grad`` (grouped like the weights, or None); the layer
adds the bias gradient. A Deconvolution (``layer.transposed``) runs the same passes the
other way round.
"""
import itertools
import math

from ...backend import cpu_threads, get_array_module


def conv_output_shape(spatial, kernel, pad, stride, dilation):
    """Caffe's convolution output size per spatial axis (floor rounding)."""
    return tuple((size + 2 * p - (d * (k - 1) + 1)) // s + 1
                 for size, k, p, s, d in zip(spatial, kernel, pad, stride, dilation))


def _zero_padded(x, pad):
    if not any(pad):
        return x
    xp = get_array_module(x)
    shape = x.shape[:2] + tuple(s + 2 * p for s, p in zip(x.shape[2:], pad))
    padded = xp.zeros(shape, x.dtype)
    padded[(slice(None), slice(None)) + tuple(slice(p, p + s) for s, p in
                                              zip(x.shape[2:], pad))] = x
    return padded


def im2col(x, kernel, pad, stride, dilation):
    """Columns ``(N, C, *kernel, *out)`` of the image ``x`` of shape ``(N, C, *spatial)``."""
    xp = get_array_module(x)
    out = conv_output_shape(x.shape[2:], kernel, pad, stride, dilation)
    if min(out) < 1:
        raise ValueError('kernel %s (dilation %s, pad %s) does not fit the input %s'
                         % (tuple(kernel), tuple(dilation), tuple(pad), x.shape[2:]))
    padded = _zero_padded(x, pad)
    step = padded.strides[2:]
    shape = padded.shape[:2] + tuple(kernel) + out
    strides = (padded.strides[:2] + tuple(t * d for t, d in zip(step, dilation))
               + tuple(t * s for t, s in zip(step, stride)))
    return xp.ascontiguousarray(xp.lib.stride_tricks.as_strided(padded, shape, strides))


def col2im(col, spatial, kernel, pad, stride, dilation):
    """The image ``(N, C, *spatial)`` whose im2col adjoint is ``col`` (sums overlaps)."""
    xp = get_array_module(col)
    nsp = len(kernel)
    out = tuple(col.shape[2 + nsp:])
    if out != conv_output_shape(spatial, kernel, pad, stride, dilation):
        raise ValueError('columns of output shape %s do not belong to an image of shape %s'
                         % (out, tuple(spatial)))
    padded_shape = col.shape[:2] + tuple(s + 2 * p for s, p in zip(spatial, pad))
    image = xp.zeros(padded_shape, col.dtype)
    every = (slice(None), slice(None))
    for offset in itertools.product(*[range(k) for k in kernel]):
        window = tuple(slice(o * d, o * d + s * (n - 1) + 1, s)
                       for o, d, s, n in zip(offset, dilation, stride, out))
        image[every + window] += col[every + offset]
    if not any(pad):
        return image
    return image[every + tuple(slice(p, p + s) for s, p in zip(spatial, pad))]


# Below this many output positions per image, per-image GEMMs are too thin to run at
# full speed, so the batch is folded into the GEMM's columns (at the cost of a transpose).
_WIDE_IMAGE = 1024


def _per_image(n, p):
    return n == 1 or p >= _WIDE_IMAGE


def grouped_matmul(w, x, out=None):
    """``y[n, g] = w[g] @ x[n, g]``: w ``(G, M, K)``, x ``(N, G, K, P)`` -> ``(N, G, M, P)``.

    ``out`` (optional, not overlapping x) receives the result.
    """
    n, g, k, p = x.shape
    if _per_image(n, p):
        return cpu_threads.batched_matmul(w, x, out=out)
    folded = x.transpose(1, 2, 0, 3).reshape(g, k, n * p)
    y = cpu_threads.batched_matmul(w, folded).reshape(g, w.shape[1], n, p).transpose(2, 0, 1, 3)
    if out is None:
        return y
    out[...] = y
    return out


def grouped_outer(a, b):
    """``sum_n a[n, g] @ b[n, g].T``: a ``(N, G, M, P)``, b ``(N, G, K, P)`` -> ``(G, M, K)``."""
    n, g, m, p = a.shape
    if n == 1:
        return cpu_threads.batched_matmul(a[0], b[0].swapaxes(1, 2))
    if p >= _WIDE_IMAGE and n <= 4:     # a few per-image products, summed
        return cpu_threads.batched_matmul(a, b.swapaxes(2, 3)).sum(axis=0)
    fold_a = a.transpose(1, 2, 0, 3).reshape(g, m, n * p)
    fold_b = b.transpose(1, 2, 0, 3).reshape(g, b.shape[2], n * p)
    return cpu_threads.batched_matmul(fold_a, fold_b.swapaxes(1, 2))


def _grouped(layer, array, positions):
    """``(N, G, rows, positions)`` view of a per-image matrix stack (N may be 0)."""
    per_image = array.size // layer.batch if layer.batch else int(math.prod(array.shape[1:]))
    rows = per_image // (layer.group * positions)
    return array.reshape(layer.batch, layer.group, rows, positions)


def _columns(layer, image, columns_of):
    """im2col of ``image`` ``(N, C, *spatial)``; the image itself for 1x1 kernels."""
    if layer.pointwise:
        return image
    try:
        return columns_of(image, layer.kernel, layer.pad, layer.stride, layer.dilation)
    except ValueError as e:
        raise layer.error(str(e)) from None


def _image(layer, col, spatial, image_of):
    """col2im of ``col`` into images of ``spatial``; the columns themselves for 1x1 kernels."""
    if layer.pointwise:
        return col
    return image_of(col, spatial, layer.kernel, layer.pad, layer.stride, layer.dilation)


def forward(layer, x, y3, columns_of=im2col, image_of=col2im):
    weight = layer.grouped_weight()
    if layer.transposed:        # Convolution's data gradient
        positions = int(math.prod(layer.in_spatial))
        col = grouped_matmul(weight.swapaxes(1, 2), _grouped(layer, x, positions))
        col = col.reshape((layer.batch, layer.num_output) + layer.kernel + layer.in_spatial)
        y3[...] = _image(layer, col, layer.out_spatial, image_of).reshape(y3.shape)
    else:
        positions = int(math.prod(layer.out_spatial))
        col = _grouped(layer, _columns(layer, x, columns_of), positions)
        grouped_matmul(weight, col, out=_grouped(layer, y3, positions))
    if layer.bias_term:
        y3 += layer.blobs[1].data.reshape(-1, 1)


def backward(layer, x, dy3, dx, weight_grad, columns_of=im2col, image_of=col2im):
    weight = layer.grouped_weight()
    if layer.transposed:        # Convolution's forward, and its weight gradient
        positions = int(math.prod(layer.in_spatial))
        dy = dy3.reshape((layer.batch, layer.num_output) + layer.out_spatial)
        col = _grouped(layer, _columns(layer, dy, columns_of), positions)
        if weight_grad is not None:
            weight_grad += grouped_outer(_grouped(layer, x, positions), col)
        if dx is not None:
            dx[...] = grouped_matmul(weight, col).reshape(dx.shape)
        return
    positions = int(math.prod(layer.out_spatial))
    grouped_dy = _grouped(layer, dy3, positions)
    if weight_grad is not None:
        weight_grad += grouped_outer(grouped_dy, _grouped(layer, _columns(layer, x, columns_of),
                                                          positions))
    if dx is not None:
        dcol = grouped_matmul(weight.swapaxes(1, 2), grouped_dy)
        dcol = dcol.reshape((layer.batch, layer.channels) + layer.kernel + layer.out_spatial)
        dx[...] = _image(layer, dcol, layer.in_spatial, image_of).reshape(dx.shape)
