"""Interp's array engine: the fork's arithmetic as array code that runs on numpy and CuPy
alike, with the signatures of the CUDA engine (gpu.py). Forward interpolates along W, then
along H (the fork's order of operations), a block of channel planes at a time; backward is
the exact adjoint, as small dense interpolation matrices."""
import numpy as np

from ...backend.cpu_threads import blocks


def interp_taps(in_size, out_size):
    """Per output index: the two source indices and their weights (float32), aligned corners."""
    ratio = (np.float32(in_size - 1) / np.float32(out_size - 1)) if out_size > 1 \
        else np.float32(0)
    source = ratio * np.arange(out_size, dtype=np.float32)
    first = source.astype(np.int64)
    second = np.minimum(first + 1, in_size - 1)
    weight_second = source - first.astype(np.float32)
    return first, second, weight_second


def interp_matrix(in_size, out_size, dtype):
    """The (out, in) matrix of the 1-D resize."""
    first, second, weight_second = interp_taps(in_size, out_size)
    weight_second = weight_second.astype(dtype)
    matrix = np.zeros((out_size, in_size), dtype)
    rows = np.arange(out_size)
    np.add.at(matrix, (rows, first), 1 - weight_second)
    np.add.at(matrix, (rows, second), weight_second)
    return matrix


def _device_taps(xp, in_size, out_size, dtype):
    first, second, weight = interp_taps(in_size, out_size)
    weight = weight.astype(dtype)
    return xp.asarray(first), xp.asarray(second), xp.asarray(1 - weight), xp.asarray(weight)


def forward(layer, bottom, top):
    xp = layer.xp
    if layer.taps is None:
        layer.taps = [_device_taps(xp, i, o, layer.dtype)
                      for i, o in zip(layer.in_hw, layer.out_hw)]
    (h_first, h_second, h_w0, h_w1), (w_first, w_second, w_w0, w_w1) = layer.taps
    x = layer.cropped(bottom[0].data)
    planes = x.reshape((-1,) + x.shape[2:])
    out = top[0].data.reshape((-1,) + layer.out_hw)

    # a block of channel planes at a time, with the same products and sums as the
    # fork: no temporary of the top's size
    def work(p0, p1):
        source = planes[p0:p1]
        along_w = w_w0 * source[:, :, w_first] + w_w1 * source[:, :, w_second]
        block = out[p0:p1]
        xp.multiply(h_w0[:, None], along_w[:, h_first], out=block)
        block += h_w1[:, None] * along_w[:, h_second]
    blocks(xp, planes.shape[0], out[0].size if len(out) else 1, work, out.dtype.itemsize)


def backward(layer, top, propagate_down, bottom):
    if not propagate_down[0]:
        return
    if layer.matrices is None:
        layer.matrices = [layer.xp.asarray(interp_matrix(i, o, layer.dtype))
                          for i, o in zip(layer.in_hw, layer.out_hw)]
    along_h, along_w = layer.matrices
    grad = along_h.T @ (top[0].diff @ along_w)
    dx = bottom[0].diff
    dx[...] = 0
    layer.cropped(dx)[...] = grad
