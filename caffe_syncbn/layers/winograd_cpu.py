"""Winograd F(2x2, 3x3) convolution on the host (numpy), for 3x3 kernels of stride 1 and
dilation 1, any pad and any groups (depthwise layers have depthwise_cpu).

The output is cut into 2x2 tiles, each computed from a 4x4 tile of the zero-padded input
(the input tiles overlap by 2). With Lavin and Gray's transforms B^T (4x4), G (4x3) and
A^T (2x4),

    U = G w G^T  (per output and input channel)     V = B^T d B  (per input tile)
    y = A^T M A,  M[r, s] = sum over input channels of U[r, s] V[r, s]

and the sum over channels is, for each of the 16 frequencies (r, s) and each group, one
GEMM: M[r, s] (K x tiles) = U[r, s] (K x C) @ V[r, s] (C x tiles). That is 16
multiply-adds per 2x2 outputs and channel pair where im2col's GEMM takes 36. The
backward is the exact adjoint of the same linear maps: dM = A dy A^T, then dV = U^T dM
(16 GEMMs) and dx = B dV B^T added back where the tiles overlap; dU = dM V^T (16 GEMMs
summed over the tiles) and dw = G^T dU G.

B^T and A^T hold only 0 and +-1, so the tile transforms are additions and subtractions of
strided views, one numpy pass per term, split over the threads by channels. The GEMMs
are split over the threads by frequency and group, each product on one thread, and the
chunks (below) do not depend on the thread count: the results are the same bit for bit
on any number of threads.

Memory: the batch runs in chunks of images, or of bands of tile rows of one image, whose
V and M take about CHUNK_BYTES (at least MIN_TILES tiles, up to MAX_CHUNK_BYTES), held in
the same per-thread buffers as conv_cpu's columns, so a net that runs both engines keeps
one set of them. The backward transforms the input again rather than keeping V.

Accuracy: the transforms add at most four terms with coefficients of magnitude 1 or 1/2,
so in float32 an output differs from the exact convolution by at most ERROR_BOUND times
the sum over its products of |weight * input| (plus |bias|); the same bound, with
products |weight * top diff| and |top diff * input|, holds for the two gradients.
tests/test_winograd.py holds every shape class to it against float64 im2col. F(4x4, 3x3)
would take 2.25 rather than 4 multiply-adds per output, but its transforms hold
coefficients up to 8 and lose about 3 more bits in float32; it is not used.

Which engine runs a layer that qualifies is a measured rule of its shape (``pays``): the
transforms are memory-bound numpy passes, which only wide enough GEMMs pay for. The
environment variable CAFFE_SYNCBN_WINOGRAD forces it: ``on`` wherever it applies,
``off`` never, ``auto`` (the default) by the rule. ``engine: CAFFE`` in a layer's
convolution_param keeps im2col for that layer.
"""
import os

import numpy as np

from ..backend import cpu_threads
from ..errors import CaffeError
from .conv_cpu import add_channel_vector, grouped_gemm, scratch

MODE_VARIABLE = 'CAFFE_SYNCBN_WINOGRAD'
MODES = ('auto', 'on', 'off')

#: the bound on |winograd - exact| / sum |products| in float32 (see the docstring)
ERROR_BOUND = 2.0 ** -19

#: the rule (benchmarks/winograd.py, docs/benchmarks.md): Winograd where every group has at
#: least MIN_CHANNELS inputs and outputs (the GEMMs save work in proportion to C * K, the
#: transforms cost passes in proportion to C + K) and the output is at least
#: MIN_OUTPUT_SIZE high and wide (the passes run along rows of W / 2 tiles, and short
#: rows cost more per value; the weights' transforms, whose cost does not shrink with the
#: image, weigh more)
MIN_CHANNELS = 64
MIN_OUTPUT_SIZE = 16

#: about how many bytes of V and M one chunk makes
CHUNK_BYTES = 4 << 20
#: ... but at least this many tiles, so that its GEMMs stay wide, as long as that takes no
#: more than MAX_CHUNK_BYTES (and one row of tiles in any case)
MIN_TILES = 128
MAX_CHUNK_BYTES = 16 << 20

BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]])
G = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]])
AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]])
#: G w G^T of a kernel w is KRON_G @ w.reshape(9): row 4 r + s, column 3 a + b
KRON_G = np.kron(G, G)


def mode():
    """CAFFE_SYNCBN_WINOGRAD: 'auto' (unset), 'on' or 'off'."""
    value = os.environ.get(MODE_VARIABLE, 'auto').strip().lower() or 'auto'
    if value not in MODES:
        raise CaffeError('%s=%s: give one of %s' % (MODE_VARIABLE, value, ', '.join(MODES)))
    return value


def applies(layer):
    """Whether this module can run ``layer`` (a Convolution set up with its geometry), and
    neither ``engine: CAFFE`` nor CAFFE_SYNCBN_WINOGRAD=off keep it on im2col."""
    cp = layer.param.convolution_param
    return (not layer.transposed and layer.num_spatial == 2 and layer.kernel == (3, 3)
            and layer.stride == (1, 1) and layer.dilation == (1, 1)
            and cp.engine != cp.CAFFE and mode() != 'off')


def pays(layer):
    """Whether Winograd runs this shape of ``layer`` (one ``applies`` accepted)."""
    forced = mode()
    if forced != 'auto':
        return forced == 'on'
    return (min(layer.channels, layer.num_output) // layer.group >= MIN_CHANNELS
            and min(layer.out_spatial) >= MIN_OUTPUT_SIZE)


def tiles(layer):
    """(tile rows, tile columns) of the output."""
    return tuple((o + 1) // 2 for o in layer.out_spatial)


def chunks(layer):
    """(first image, last image, first tile row, last tile row) of each chunk."""
    rows, cols = tiles(layer)
    per_tile = 16 * (layer.channels + layer.num_output) * np.dtype(layer.dtype).itemsize
    budget = max(CHUNK_BYTES, min(MAX_CHUNK_BYTES, per_tile * MIN_TILES))
    per_image = per_tile * rows * cols
    if per_image <= budget:
        step = budget // per_image
        return [(n, min(layer.batch, n + step), 0, rows) for n in range(0, layer.batch, step)]
    band = max(1, budget // (per_tile * cols))
    return [(n, n + 1, t, min(rows, t + band))
            for n in range(layer.batch) for t in range(0, rows, band)]


# ---- passes over strided views ------------------------------------------------------------
def _combine(out, coefficients, term, accumulate=False):
    """``out`` (+)= sum_i coefficients[i] * term(i), for coefficients 0 and +-1."""
    terms = [(k, i) for i, k in enumerate(coefficients) if k]
    if not accumulate:
        (k, i), terms = terms[0], terms[1:]
        if terms:
            (k1, i1), terms = terms[0], terms[1:]
            if k > 0:
                (np.add if k1 > 0 else np.subtract)(term(i), term(i1), out=out)
            elif k1 > 0:
                np.subtract(term(i1), term(i), out=out)
            else:
                np.add(term(i), term(i1), out=out)
                np.negative(out, out=out)
        elif k > 0:
            np.copyto(out, term(i))
        else:
            np.negative(term(i), out=out)
    for k, i in terms:
        (np.add if k > 0 else np.subtract)(out, term(i), out=out)


def _along(array, axis, index):
    """``array[..., index, ...]`` with ``index`` on ``axis``."""
    return array[(slice(None),) * (axis % array.ndim) + (index,)]


def _tile_cells(array, axis, j, count):
    """Cell j of each of ``count`` 4-cell tiles at steps of 2 along ``axis``."""
    return _along(array, axis, slice(j, j + 2 * count, 2))


def _transform(out, source, matrix, axis):
    """out[r] = sum_j matrix[r, j] * (cell j of each tile of ``source`` along ``axis``),
    for the rows r of ``matrix``; ``source`` holds 2 * tiles + 2 cells along ``axis``."""
    count = out.shape[1:][axis]
    for r in range(matrix.shape[0]):
        _combine(out[r], matrix[r], lambda j: _tile_cells(source, axis, j, count))


def _adjoint(target, term, matrix, axis, count):
    """The adjoint of ``_transform``: ``target`` (2 * count + 2 cells along ``axis``) =
    sum_j cell j of each tile <- sum_r matrix[r, j] * term(r), tiles overlapping."""
    for j in range(matrix.shape[1]):
        cells = _tile_cells(target, axis, j, count)
        if j < 2:                    # the first two cells of each tile are written first
            _combine(cells, matrix[:, j], term)
        else:
            if j == 2:
                _along(target, axis, slice(2 * count, 2 * count + 2))[...] = 0
            _combine(cells, matrix[:, j], term, accumulate=True)


def _fill(block, source, row, col):
    """``block`` (channels, images, rows, cols) = the cells of ``source`` (channels, images,
    H, W) from (row, col) on, zero outside it."""
    rows, cols = block.shape[2:]
    h, w = source.shape[2:]
    r0, r1 = min(rows, max(0, -row)), max(0, min(rows, h - row))
    c0, c1 = min(cols, max(0, -col)), max(0, min(cols, w - col))
    for index in (np.s_[:, :, :r0], np.s_[:, :, max(r0, r1):], np.s_[:, :, :, :c0],
                  np.s_[:, :, :, max(c0, c1):]):
        block[index] = 0
    if r1 > r0 and c1 > c0:
        block[:, :, r0:r1, c0:c1] = source[:, :, row + r0:row + r1, col + c0:col + c1]


def _add_back(block, target, row, col):
    """``target`` (channels, images, H, W) += the cells of ``block`` that fall inside it,
    ``block`` starting at (row, col)."""
    rows, cols = block.shape[2:]
    h, w = target.shape[2:]
    r0, r1 = max(0, -row), min(rows, h - row)
    c0, c1 = max(0, -col), min(cols, w - col)
    if r1 > r0 and c1 > c0:
        target[:, :, row + r0:row + r1, col + c0:col + c1] += block[:, :, r0:r1, c0:c1]


# ---- the transforms of a chunk ------------------------------------------------------------
def _weights(layer):
    """U (16, G, K/G, C/G): G w G^T of every 3x3 kernel."""
    w = layer.blobs[0].data
    u = cpu_threads.matmul(KRON_G.astype(w.dtype), w.reshape(-1, 9).T)      # (16, K * C)
    g = layer.group
    return u.reshape(16, g, w.shape[0] // g, w.shape[1])


def _input_tiles(layer, x, chunk, v):
    """v (4, 4, C, images, tile rows, tile cols) = B^T d B of the chunk's input tiles."""
    n0, n1, t0, t1 = chunk
    c, rows, cols = layer.channels, t1 - t0, v.shape[-1]
    block = scratch('block', (c, n1 - n0, 2 * rows + 2, 2 * cols + 2), x.dtype)
    source = x[n0:n1].swapaxes(0, 1)

    def work(c0, c1):
        part = block[c0:c1]
        _fill(part, source[c0:c1], 2 * t0 - layer.pad[0], -layer.pad[1])
        half = scratch('winograd rows', (4,) + part.shape[:3] + (cols,), x.dtype)
        _transform(half, part, BT, -1)              # d B, then B^T (d B)
        for s in range(4):
            _transform(v[:, s, c0:c1], half[s], BT, 2)
    cpu_threads.split_rows(c, block[0].size * 4, work)


def _output_tiles(m, target, k0, k1):
    """``target`` (K, images, rows, W) = A^T M A of every tile, channels [k0, k1)."""
    part = m[:, :, k0:k1]
    half = scratch('winograd rows', (2, 4) + part.shape[2:], m.dtype)
    for b in range(2):                          # M A, then A^T (M A)
        for r in range(4):
            _combine(half[b, r], AT[b], lambda s: part[r, s])
    for a in range(2):
        for b in range(2):
            out = target[k0:k1, :, a::2, b::2]
            _combine(out, AT[a], lambda r: half[b, r][..., :out.shape[2], :out.shape[3]])


def _top_tiles(layer, dy4, chunk, dm):
    """dm (4, 4, K, images, tile rows, tile cols) = A dy A^T of the chunk's top diff."""
    n0, n1, t0, t1 = chunk
    k, rows, cols = layer.num_output, t1 - t0, dm.shape[-1]
    block = scratch('block', (k, n1 - n0, 2 * rows, 2 * cols), dy4.dtype)
    source = dy4[n0:n1].swapaxes(0, 1)

    def work(k0, k1):
        part = block[k0:k1]
        _fill(part, source[k0:k1], 2 * t0, 0)
        half = scratch('winograd rows', (4,) + part.shape[:3] + (cols,), dy4.dtype)
        for s in range(4):                      # dy A^T, then A (dy A^T)
            _combine(half[s], AT[:, s], lambda b: part[..., b::2])
        for s in range(4):
            for r in range(4):
                _combine(dm[r, s, k0:k1], AT[:, r], lambda a: half[s][:, :, a::2])
    cpu_threads.split_rows(k, block[0].size * 4, work)


def _input_gradient(layer, dv, dx4, chunk):
    """dx4 (N, C, H, W) += B dV B^T of every tile of the chunk, where the tiles overlap."""
    n0, n1, t0, t1 = chunk
    c, rows, cols = layer.channels, t1 - t0, dv.shape[-1]
    block = scratch('block', (c, n1 - n0, 2 * rows + 2, 2 * cols + 2), dx4.dtype)
    target = dx4[n0:n1].swapaxes(0, 1)

    def work(c0, c1):
        part = block[c0:c1]
        half = scratch('winograd rows', (4, c1 - c0, n1 - n0, rows, 2 * cols + 2), dx4.dtype)
        for r in range(4):
            _adjoint(half[r], lambda s: dv[r, s, c0:c1], BT, -1, cols)
        _adjoint(part, lambda r: half[r], BT, 2, rows)
        _add_back(part, target[c0:c1], 2 * t0 - layer.pad[0], -layer.pad[1])
    cpu_threads.split_rows(c, block[0].size * 4, work)


# ---- the layer's passes -------------------------------------------------------------------
def _buffers(layer, chunk, name, channels):
    n0, n1, t0, t1 = chunk
    return scratch(name, (4, 4, channels, n1 - n0, t1 - t0, tiles(layer)[1]), layer.dtype)


def _gemm_view(array, groups):
    """(16, G, rows, tiles) view of a (4, 4, G * rows, images, tile rows, tile cols) array."""
    return array.reshape(16, groups, array.shape[2] // groups, -1)


def forward(layer, x4, y3):
    """``y3`` (N, K, OH*OW) = the convolution of ``x4`` (N, C, H, W), bias included."""
    u, g = _weights(layer), layer.group
    y4 = y3.reshape(y3.shape[:2] + tuple(layer.out_spatial))
    for chunk in chunks(layer):
        n0, n1, t0, t1 = chunk
        v = _buffers(layer, chunk, 'columns', layer.channels)
        _input_tiles(layer, x4, chunk, v)
        m = _buffers(layer, chunk, 'per group', layer.num_output)
        cpu_threads.batched_matmul(u, _gemm_view(v, g), out=_gemm_view(m, g))
        target = y4[n0:n1, :, 2 * t0:2 * t1].swapaxes(0, 1)
        cpu_threads.split_rows(layer.num_output, m[0, 0, 0].size * 16,
                               lambda k0, k1: _output_tiles(m, target, k0, k1))
    if layer.bias_term:
        add_channel_vector(y3, layer.blobs[1].data)


def backward(layer, x4, dy3, dx4, weight_grad):
    """Accumulate the weight gradient into ``weight_grad`` (shaped like the weights, or
    None) and write ``dx4`` (N, C, H, W, or None) from ``dy3`` (N, K, OH*OW)."""
    u, g = _weights(layer), layer.group
    dy4 = dy3.reshape(dy3.shape[:2] + tuple(layer.out_spatial))
    du = None if weight_grad is None else np.zeros(u.shape, u.dtype)
    for chunk in chunks(layer):
        n0, n1, t0, t1 = chunk
        dm = _buffers(layer, chunk, 'per group', layer.num_output)
        _top_tiles(layer, dy4, chunk, dm)
        v = _buffers(layer, chunk, 'columns', layer.channels)
        if du is not None:
            _input_tiles(layer, x4, chunk, v)
            grouped_gemm(_gemm_view(dm, g).reshape(16 * g, du.shape[2], -1),
                         _gemm_view(v, g).reshape(16 * g, du.shape[3], -1).swapaxes(1, 2),
                         du.reshape(16 * g, du.shape[2], du.shape[3]), accumulate=True)
        if dx4 is not None:
            if t0 == 0:
                dx4[n0:n1] = 0
            cpu_threads.batched_matmul(u.swapaxes(2, 3), _gemm_view(dm, g),
                                       out=_gemm_view(v, g))
            _input_gradient(layer, v, dx4, chunk)
    if du is not None:
        cpu_threads.matmul(du.reshape(16, -1).T, KRON_G.astype(du.dtype),
                           out=weight_grad.reshape(-1, 9), accumulate=True)
