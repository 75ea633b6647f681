"""im2col / col2im for N-D convolutions with pad, stride and dilation.

Column layout (the contract the GPU kernels must keep):  ``(N, C, *kernel, *out)``,
so that ``col.reshape(N, C * prod(kernel), prod(out))`` is the matrix that one
convolution GEMM per image multiplies, with rows ordered (channel, kernel offsets) as
in Caffe (this is also the channel order of the Im2col layer's top).

``im2col`` is one strided view over the zero-padded image, copied once; ``col2im`` is
its adjoint (overlapping windows add up), a loop over the kernel offsets.
"""
import itertools

from ...backend import get_array_module


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
