"""The columns of a chunk of a host convolution (host_gemm.py), and their gradients back
into the image: im2col and col2im in the chunk's layout, in per-thread buffers.

im2col copies a strided view of the (zero-padded) input block in one pass. col2im adds
each kernel offset's column gradients into a zeroed block, window by window, or, where
they come as large as the block (``padded_columns``), in one run: their extra cells hold
zeros, which add nothing, so the sums are the same.
"""
import itertools
import math
import threading

import numpy as np

from ...backend import cpu_threads
from ...blob import out_of_memory

#: col2im adds each kernel offset's column gradients to the block in one contiguous run
#: where they come as large as the padded input block, zeros past the outputs (a 2-D
#: convolution of stride 1), if that takes at most this many times the positions: numpy
#: adds a window of rows at a quarter of its contiguous speed, and more slowly still for
#: short rows, which costs more than the GEMM's extra columns
PADDED_COLUMNS = 1.6
#: ... and if the top diff, which is then copied into blocks of that size row by row, has
#: at most this share of the rows of the columns that col2im would add window by window
#: (LeNet's first convolution, 20 outputs for 25 column rows, gains nothing: padding its
#: top and the larger GEMM take what col2im saves)
PADDED_TOP_SHARE = 0.25

#: col2im goes by the stride's phases where each phase takes at least this many kernel
#: offsets: zeroing the phases and adding them to the image cost about what a few strided
#: adds do (backward of AlexNet's 11 x 11 / 4 conv1: 0.93 of the time by windows, ResNet-50's
#: 7 x 7 / 2: 0.95; a 3 x 3 / 2 took 1.08)
PHASE_OFFSETS = 4

_buffers = threading.local()


def scratch(name, shape, dtype):
    """A buffer of the calling thread for ``name``; it grows to the largest size asked
    (the smaller one goes first, so that both are never held)."""
    pool = _buffers.__dict__.setdefault('pool', {})
    size = int(math.prod(shape))
    buffer = pool.get((name, dtype))
    if buffer is None or buffer.size < size:
        pool.pop((name, dtype), None)
        try:
            buffer = pool[(name, dtype)] = np.empty(size, dtype)
        except MemoryError:
            raise out_of_memory("the convolution's buffer of %s %s" % (name, list(shape)),
                                size * np.dtype(dtype).itemsize) from None
    return buffer[:size].reshape(shape)


def _padded_spatial(layer, chunk):
    lo, hi = chunk.rows_in
    return (hi - lo,) + tuple(s + 2 * p for s, p in zip(layer.in_spatial[1:], layer.pad[1:]))


def _inside(layer, chunk):
    """(the spatial slices of the padded rows that the image fills, its rows)."""
    lo, hi = chunk.rows_in
    pad, spatial = layer.pad, layer.in_spatial
    top = max(lo, pad[0])
    bottom = max(top, min(hi, pad[0] + spatial[0]))     # a band may lie in the padding
    cells = (slice(top - lo, bottom - lo),) + tuple(
        slice(p, p + s) for s, p in zip(spatial[1:], pad[1:]))
    return cells, slice(top - pad[0], bottom - pad[0])


def _input_block(layer, x, chunk):
    """The chunk's rows of ``x`` (N, C, *spatial), zero-padded, in the chunk's order: a
    view of x for one unpadded image."""
    images = x[chunk.first:chunk.last]
    if _direct(layer, chunk):
        lo, hi = chunk.rows_in
        return chunk.order(images[:, :, lo:hi])
    block = scratch('block', chunk.shape((layer.channels,), _padded_spatial(layer, chunk)),
                    x.dtype)
    cells, rows = _inside(layer, chunk)
    cells = chunk.cells(cells)
    source = chunk.order(images[:, :, rows])

    def fill(c0, c1):
        if any(layer.pad):
            block[c0:c1] = 0
        block[c0:c1][cells] = source[c0:c1]
    cpu_threads.split_rows(layer.channels, block[0].size, fill)
    return block


def _window(layer, offset, chunk):
    """The cells of an input block that kernel offset ``offset`` reads, per output."""
    return chunk.cells(tuple(slice(o * d, o * d + s * (n - 1) + 1, s) for o, d, s, n in
                             zip(offset, layer.dilation, layer.stride, chunk.out_shape)))


def _offsets(layer):
    return list(itertools.product(*[range(k) for k in layer.kernel]))


def _windows(layer, block, chunk):
    """A strided view of an input block as the chunk's columns: (C, *kernel, images and
    positions) in the chunk's order, each cell the input cell it reads."""
    steps = block.strides[1:-1] if chunk.images_last else block.strides[2:]
    image_step = (block.strides[-1] if chunk.images_last else block.strides[1],)
    kernel = tuple(t * d for t, d in zip(steps, layer.dilation))
    outputs = tuple(t * s for t, s in zip(steps, layer.stride))
    strides = ((block.strides[0],) + kernel
               + (outputs + image_step if chunk.images_last else image_step + outputs))
    shape = chunk.shape((layer.channels,) + layer.kernel, chunk.out_shape)
    if not block.flags.c_contiguous:         # a view of the input
        return np.lib.stride_tricks.as_strided(block, shape, strides, writeable=False)
    # the same view of a buffer of its own, made in a microsecond where as_strided takes ten
    windows = np.ndarray(shape, block.dtype, buffer=block, strides=strides)
    windows.flags.writeable = False
    return windows


def columns(layer, x, chunk):
    """im2col: the chunk's columns ``(C, *kernel, images and positions)``, in a scratch
    buffer, copied from a strided view of the input in one pass."""
    windows = _windows(layer, _input_block(layer, x, chunk), chunk)
    cols = scratch('columns', windows.shape, x.dtype)
    c, rows = layer.channels, layer.kernel[0]

    def copy(c0, c1):
        cols[c0:c1] = windows[c0:c1]
    if c >= cpu_threads.threads():
        cpu_threads.split_rows(c, cols[0].size, copy)
    else:          # few channels (a first layer): the kernel rows are split instead
        cpu_threads.split_rows(rows, cols.size // rows,
                               lambda i0, i1: np.copyto(cols[:, i0:i1], windows[:, i0:i1]))
    return cols


def padded_columns(layer, chunk):
    """Whether the chunk's column gradients come as large as its padded input block, rows
    ordered (kernel offset, channel) (PADDED_COLUMNS: one group, images first, 2-D, stride
    1, a block of its own or a whole image, and PADDED_TOP_SHARE)."""
    if chunk.images_last or layer.group != 1 or layer.num_spatial != 2 or \
            tuple(layer.stride) != (1, 1) or \
            layer.num_output > PADDED_TOP_SHARE * layer.channels * layer.kernel_count:
        return False
    if _direct(layer, chunk) and chunk.rows_in != (0, layer.in_spatial[0]):
        return False
    rows, width = _padded_spatial(layer, chunk)
    return rows * width <= PADDED_COLUMNS * chunk.positions


def padded_top(layer, dy, chunk):
    """The chunk's images of ``dy`` (N, O, P) in blocks of the padded input block's shape,
    zeros past the outputs, as (images, 1, O, block size)."""
    outputs = dy.shape[1]
    rows, columns = chunk.out_shape
    padded = scratch('padded top', (chunk.images, outputs) + _padded_spatial(layer, chunk),
                     dy.dtype)
    padded[...] = 0
    padded[:, :, :rows, :columns] = dy[chunk.first:chunk.last, :, chunk.columns].reshape(
        chunk.images, outputs, rows, columns)
    return padded.reshape(chunk.images, 1, outputs, -1)


def offset_major(layer, weight):
    """The grouped weights (1, O, C * K), a copy with their columns ordered (kernel offset,
    channel), as ``padded_columns`` orders the rows of the column gradients."""
    outputs = weight.shape[1]
    return weight.reshape(outputs, layer.channels, layer.kernel_count).transpose(
        0, 2, 1).reshape(1, outputs, -1)


def _direct(layer, chunk):
    """Whether the chunk's input block is a view of the input (one unpadded image)."""
    return chunk.images == 1 and not any(layer.pad)


def writes_images(layer, chunk):
    """Whether col2im of the chunk writes every input row of its images (the first band,
    padded), so that dx needs no zeros first."""
    return not _direct(layer, chunk) and chunk.row == 0 and \
        _inside(layer, chunk)[1].stop == layer.in_spatial[0]


def add_columns_to_image(layer, dcols, dx, chunk, padded=False):
    """col2im: the chunk's column gradients ``dcols`` summed into ``dx`` (N, C, *spatial),
    which holds zeros (or the sums of earlier bands of the same image) unless the chunk
    ``writes_images``. ``padded``: they come as ``padded_columns`` lays them out."""
    c = layer.channels
    direct = _direct(layer, chunk)
    writes = writes_images(layer, chunk)
    images = dx[chunk.first:chunk.last]
    if direct:
        lo, hi = chunk.rows_in
        block = chunk.order(images[:, :, lo:hi])
    else:
        block = scratch('block', chunk.shape((c,), _padded_spatial(layer, chunk)), dx.dtype)
        cells, rows = _inside(layer, chunk)
        cells = chunk.cells(cells)
        target = chunk.order(images[:, :, rows])
    offsets = _offsets(layer)
    if not padded:
        source = dcols.reshape(chunk.shape((c,) + layer.kernel, chunk.out_shape))
        phases = by_phases(layer, chunk)

        def add_offsets(c0, c1):
            part = block[c0:c1]
            if phases:
                _add_by_phases(layer, part, source[c0:c1], chunk, offsets)
                return
            for offset in offsets:
                part[_window(layer, offset, chunk)] += source[(slice(c0, c1),) + offset]
    else:
        # A kernel offset adds the block shifted by ``start``: one run over the channels
        # [c0, c1), where each channel's cells past its outputs add zeros to the next
        size = block[0].size
        source = dcols.reshape(len(offsets), c * size)
        flat = (images if direct else block).reshape(-1)     # both contiguous: a view
        width = block.shape[-1]
        starts = [i * layer.dilation[0] * width + j * layer.dilation[1] for i, j in offsets]

        def add_offsets(c0, c1):
            for k, start in enumerate(starts):
                flat[c0 * size + start:c1 * size] += source[k, c0 * size:c1 * size - start]

    def add(c0, c1):
        if not direct:
            block[c0:c1] = 0
        add_offsets(c0, c1)
        if writes:
            target[c0:c1] = block[c0:c1][cells]
        elif not direct:
            target[c0:c1] += block[c0:c1][cells]
    cpu_threads.split_rows(c, block[0].size * len(offsets), add)


def by_phases(layer, chunk):
    """Whether col2im adds a chunk's column gradients by the stride's phases
    (``_add_by_phases``): a 2-D convolution of stride above 1 along its rows, without
    dilation, its images first (with the images last, a window's rows are contiguous),
    with PHASE_OFFSETS kernel offsets or more to each phase."""
    return layer.num_spatial == 2 and layer.stride[1] > 1 and \
        tuple(layer.dilation) == (1, 1) and not chunk.images_last and \
        layer.kernel_count >= PHASE_OFFSETS * math.prod(layer.stride)


def _add_by_phases(layer, part, source, chunk, offsets):
    """col2im of a strided convolution: ``source`` (C, *kernel, images, *outputs) added
    into ``part`` (C, images, *spatial). A kernel offset's window has the stride's step
    along a row, which numpy adds element by element. The cells that leave the same
    remainders by the stride (a phase) lie one cell apart in a buffer of their own, and
    the offsets that a whole number of strides separate add to the same phase, each
    window there a block of contiguous rows: each offset is added to its phase, then
    each phase to ``part`` once (stride**2 strided adds, not one per offset)."""
    (sy, sx), (height, width) = layer.stride, part.shape[-2:]
    rows, columns = chunk.out_shape
    phases = scratch('phases', (sy, sx) + part.shape[:-2] + (-(-height // sy), -(-width // sx)),
                     part.dtype)
    phases[...] = 0
    for ky, kx in offsets:
        iy, ix = ky // sy, kx // sx
        phases[ky % sy, kx % sx, ..., iy:iy + rows, ix:ix + columns] += source[:, ky, kx]
    for py in range(min(sy, height)):
        for px in range(min(sx, width)):
            cells = part[..., py::sy, px::sx]
            cells += phases[py, px, ..., :cells.shape[-2], :cells.shape[-1]]
