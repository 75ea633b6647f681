"""Convolution's CUDA engine: the array engine's passes (array.py) with im2col / col2im of
2-D convolutions on the GPU (cuda/conv.cu), in its column layout ``(N, C, *kernel, *out)``,
and the GEMMs of cupy.matmul (cuBLAS). 2-D only: other dimensionalities stay on the array
engine, which runs on CuPy as well."""
from ...backend import cuda_kernels, get_array_module
from ...backend.launch import BLOCK, contiguous, grid_1d, i32
from . import array


def forward(layer, x, y3):
    array.forward(layer, x, y3, im2col, col2im)


def backward(layer, x, dy3, dx, weight_grad):
    array.backward(layer, x, dy3, dx, weight_grad, im2col, col2im)


def _geometry(n, c, spatial, kernel, pad, stride, dilation, out):
    return tuple(i32(v) for v in (n, c) + tuple(spatial) + tuple(kernel) + tuple(pad)
                 + tuple(stride) + tuple(dilation) + tuple(out))


def im2col(x, kernel, pad, stride, dilation):
    """Columns ``(N, C, KH, KW, OH, OW)`` of ``x`` ``(N, C, H, W)``."""
    if x.ndim != 4:
        raise ValueError('the im2col kernel takes (N, C, H, W) images, got shape %s' % (x.shape,))
    xp = get_array_module(x)
    out = array.conv_output_shape(x.shape[2:], kernel, pad, stride, dilation)
    if min(out) < 1:
        raise ValueError('kernel %s (dilation %s, pad %s) does not fit the input %s'
                         % (tuple(kernel), tuple(dilation), tuple(pad), x.shape[2:]))
    x = contiguous(xp, x)
    n, c = x.shape[:2]
    col = xp.empty((n, c) + tuple(kernel) + out, x.dtype)
    if col.size:
        cuda_kernels.typed_kernel('conv', 'im2col', x.dtype)(
            grid_1d(n * c * out[0] * out[1]), (BLOCK,),
            (x,) + _geometry(n, c, x.shape[2:], kernel, pad, stride, dilation, out) + (col,))
    return col


def col2im(col, spatial, kernel, pad, stride, dilation):
    """The image ``(N, C, H, W)`` whose im2col adjoint is ``col`` (overlaps summed)."""
    if len(kernel) != 2:
        raise ValueError('the col2im kernel takes 2-D kernels, got %s' % (tuple(kernel),))
    xp = get_array_module(col)
    out = tuple(col.shape[4:])
    if out != array.conv_output_shape(spatial, kernel, pad, stride, dilation):
        raise ValueError('columns of output shape %s do not belong to an image of shape %s'
                         % (out, tuple(spatial)))
    col = contiguous(xp, col)
    n, c = col.shape[:2]
    image = xp.empty((n, c) + tuple(spatial), col.dtype)
    if image.size:
        cuda_kernels.typed_kernel('conv', 'col2im', col.dtype)(
            grid_1d(image.size), (BLOCK,),
            (col,) + _geometry(n, c, spatial, kernel, pad, stride, dilation, out) + (image,))
    return image
