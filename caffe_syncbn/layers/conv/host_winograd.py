"""Winograd F(2x2, 3x3) convolution on the host (numpy), for 3x3 kernels of stride 1 and
dilation 1, any pad and any groups (depthwise layers have host_depthwise.py).

The output is cut into 2x2 tiles, each computed from a 4x4 tile of the zero-padded input
(the input tiles overlap by 2). With Lavin and Gray's transforms B^T (4x4), G (4x3) and
A^T (2x4),

    U = G w G^T  (per output and input channel)     V = B^T d B  (per input tile)
    y = A^T M A,  M[r, s] = sum over input channels of U[r, s] V[r, s]

and the sum over channels is, for each of the 16 frequencies (r, s) and each group, one
GEMM: M[r, s] (K x tiles) = U[r, s] (K x C) @ V[r, s] (C x tiles), computed transposed
(tiles x C by C x K) as the chunks lay channels last. That is 16
multiply-adds per 2x2 outputs and channel pair where im2col's GEMM takes 36. The
backward is the exact adjoint of the same linear maps: dM = A dy A^T, then dV = U^T dM
(16 GEMMs) and dx = B dV B^T added back where the tiles overlap; dU = dM V^T (16 GEMMs
summed over the tiles) and dw = G^T dU G.

B^T and A^T hold only 0 and +-1, so the tile transforms (winograd_tiles.py) are additions
and subtractions of strided views of a chunk's arrays, laid out (tile rows, tile cols,
images, channels) so that each pass runs along images * channels contiguous values. The
forward runs its chunks on several threads at once, each in its own buffers. The
backward sums the weight gradient over the chunks in their order, one chunk after the
other: its passes split the tile rows over the threads, its GEMMs the frequencies and
groups, each product on one thread. The chunks (below) do not depend on the thread
count, so the results are the same bit for bit on any number of threads.

Memory: the batch runs in chunks of images, or of bands of tile rows of one image, whose
V and M take about CHUNK_BYTES (at least MIN_TILES tiles, up to MAX_CHUNK_BYTES). The
forward writes each frequency of M over that of V (through a buffer of one frequency),
so each thread holds the wider of the two, in the buffer of host_gemm's columns (a net
that runs both engines keeps one of them); the tile transforms go by bands of tile
rows, whose temporaries take about TRANSFORM_BYTES. The backward holds V and dM side by
side and transforms the input again rather than keeping V.

Accuracy: in float32, each value (a top cell, a bottom diff cell, a weight diff) differs
from the exact one by at most ERROR_BOUND = 2^-19 (32 units of float32 rounding) times
S, the largest sum of |products| among its neighbours: for a cell of the top, the sum of
|weight * input| (and |bias|) over the products that make it, taken over the cells
within one row and one column of it; for the bottom diff likewise with |weight * top
diff|; for a weight diff, the sum of |top diff * input| over its products, the largest
of its kernel's 9 taps. (The neighbours are there because a tile's values come out of
one transform: where S of a value is 0, as for a tap that only ever meets padding, it
still carries the rounding of its tile.) tests/layers/test_conv_winograd.py holds every shape class
to it against float64 im2col, with inputs of mixed sign (errors up to 5 units there, as
im2col's) and of one sign over 2304 products per output (up to 23 units; im2col's 13):
one-signed sums of many more products round more in any float32 GEMM. F(4x4, 3x3) would
take 2.25 rather than 4 multiply-adds per output, but its transforms' coefficients reach
8 rather than 1 and scale the rounding of the terms they weigh; it is not built.

Which engine runs a layer that qualifies is a measured rule of its shape (``pays``): the
transforms are memory-bound numpy passes, which only wide enough GEMMs pay for. The
environment variable CAFFE_SYNCBN_WINOGRAD forces it: ``on`` wherever it applies,
``off`` never, ``auto`` (the default) by the rule. ``engine: CAFFE`` in a layer's
convolution_param keeps im2col for that layer.
"""
import math
import os

import numpy as np

from ...backend import cpu_threads
from ...errors import CaffeError
from .host_columns import scratch
from .winograd_tiles import (AT, BT, KRON_G, add_back, adjoint, combine, fill, tile_cells,
                             transform)

MODE_VARIABLE = 'CAFFE_SYNCBN_WINOGRAD'
MODES = ('auto', 'on', 'off')

#: the bound on |winograd - exact| / S in float32 (S: see the docstring)
ERROR_BOUND = 2.0 ** -19

#: the rule (benchmarks/winograd.py, docs/benchmarks.md): Winograd where every group has at
#: least MIN_CHANNELS inputs and outputs (the GEMMs save work in proportion to C * K, the
#: tile transforms cost passes in proportion to C + K), the batch has at least
#: MIN_BATCH_TILES tiles (the weights' transforms, three a step, cost as much whatever
#: the batch, and a chunk of fewer tiles splits every pass between the threads, which
#: then wait for each other often), and each image at least MIN_IMAGE_TILES (the copies
#: between the blobs' (N, C, H, W) and the chunks' (tile rows, tile cols, images,
#: channels) move runs of W values, and short runs cost more per value). Shapes just
#: below a bound measured anywhere from 0.7 to 1.3 times im2col's time, from one run to
#: the next and with the machine's load.
MIN_CHANNELS = 64
MIN_BATCH_TILES = 128
MIN_IMAGE_TILES = 49

#: about how many bytes of V and M one chunk makes: more than im2col's columns, as every
#: chunk costs a few waits between the threads, and on two idle cores chunks of 4 MiB
#: made ResNet-50's step at batch 2 slower than im2col's (1.11x), chunks of 16 MiB
#: faster (0.95x), for 1.5 % more peak memory
CHUNK_BYTES = 16 << 20
#: ... but at least this many tiles, so that its GEMMs stay wide, as long as that takes no
#: more than MAX_CHUNK_BYTES (and one row of tiles in any case)
MIN_TILES = 512
MAX_CHUNK_BYTES = 32 << 20
#: the tile transforms go through a chunk by bands of tile rows whose temporaries take
#: about this many bytes: they stay small whatever the chunk
TRANSFORM_BYTES = 2 << 20


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
    rows, cols = tiles(layer)
    return (min(layer.channels, layer.num_output) // layer.group >= MIN_CHANNELS
            and rows * cols >= MIN_IMAGE_TILES and layer.batch * rows * cols >= MIN_BATCH_TILES)


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


# ---- the transforms of a chunk: (tile rows, tile cols, images, channels) arrays ----------
def _weights(layer):
    """U (16, G, K/G, C/G): G w G^T of every 3x3 kernel."""
    w = layer.blobs[0].data
    u = cpu_threads.matmul(KRON_G.astype(w.dtype), w.reshape(-1, 9).T)      # (16, K * C)
    g = layer.group
    return u.reshape(16, g, w.shape[0] // g, w.shape[1])


def _bands(first, last, row_bytes):
    """[first, last) cut into bands of tile rows of about TRANSFORM_BYTES, ``row_bytes``
    each (at least one row a band)."""
    band = max(1, TRANSFORM_BYTES // max(1, row_bytes))
    return [(a, min(last, a + band)) for a in range(first, last, band)]


def _input_tiles(layer, x4, chunk, v):
    """v (4, 4, tile rows, tile cols, images, C) = B^T d B of the chunk's input tiles."""
    n0, n1, t0, t1 = chunk
    cols = v.shape[3]
    source = x4[n0:n1].transpose(2, 3, 0, 1)
    block_row = (2 * cols + 2) * (n1 - n0) * layer.channels * x4.itemsize

    def work(a, b):              # each thread copies the input rows its tiles read
        for first, last in _bands(a, b, 2 * block_row):
            part = scratch('block', (2 * (last - first) + 2, 2 * cols + 2, n1 - n0,
                                     layer.channels), x4.dtype)
            fill(part, source, 2 * (t0 + first) - layer.pad[0], -layer.pad[1])
            column = scratch('winograd rows', (len(part), cols) + part.shape[2:], x4.dtype)
            for s in range(4):                        # column s of d B, then B^T (d B)
                combine(column, BT[s], lambda j: tile_cells(part, 1, j, cols))
                transform(v[:, s, first:last], column, BT, 0)
    cpu_threads.split_rows(t1 - t0, v[0, 0, 0].size * 16, work)


def _output_tiles(m, target, a, b):
    """``target`` (output rows, W, images, K) = A^T M A of the tile rows [a, b), by bands
    of them. Each cell of the tiles is summed in a buffer, then copied into the
    (transposed) target in one pass."""
    for first, last in _bands(a, b, 4 * m[0, 0, 0].nbytes):
        part = m[:, :, first:last]
        half = scratch('winograd rows', (4,) + part.shape[2:], m.dtype)
        cells = scratch('winograd cells', part.shape[2:], m.dtype)
        for j in range(2):                            # column j of M A, then A^T (M A)
            for r in range(4):
                combine(half[r], AT[j], lambda s: part[r, s])
            for i in range(2):
                out = target[2 * first + i:2 * last:2, j::2]
                combine(cells, AT[i], lambda r: half[r])
                out[...] = cells[:out.shape[0], :out.shape[1]]


def _top_tiles(layer, dy4, chunk, dm):
    """dm (4, 4, tile rows, tile cols, images, K) = A dy A^T of the chunk's top diff."""
    n0, n1, t0, t1 = chunk
    cols = dm.shape[3]
    source = dy4[n0:n1].transpose(2, 3, 0, 1)

    def work(a, b):
        part = scratch('block', (2 * (b - a), 2 * cols, n1 - n0, layer.num_output), dy4.dtype)
        fill(part, source, 2 * (t0 + a), 0)
        half = scratch('winograd rows', (4, len(part), cols) + part.shape[2:], dy4.dtype)
        for s in range(4):                            # dy A^T, then A (dy A^T)
            combine(half[s], AT[:, s], lambda j: part[:, j::2])
        for s in range(4):
            for r in range(4):
                combine(dm[r, s, a:b], AT[:, r], lambda i: half[s][i::2])
    cpu_threads.split_rows(t1 - t0, dm[0, 0, 0].size * 16, work)


def _input_gradient(layer, dv, dx4, chunk):
    """dx4 (N, C, H, W) += B dV B^T of every tile of the chunk, where the tiles overlap,
    in two passes over the tile rows, split over the threads: the first sums the columns'
    overlaps and writes the first two rows of cells of each tile; the second adds the
    last two rows of each tile onto the next tile's first two, then adds the rows it
    completed into dx. No two threads write the same cell."""
    n0, n1, t0, t1 = chunk
    rows, cols = t1 - t0, dv.shape[3]
    block = scratch('block', (2 * rows + 2, 2 * cols + 2, n1 - n0, layer.channels), dx4.dtype)
    half = scratch('winograd columns', (4, rows) + block.shape[1:], dx4.dtype)
    target = dx4[n0:n1].transpose(2, 3, 0, 1)
    whole = rows == tiles(layer)[0]

    def first(a, b):
        for r in range(4):
            adjoint(half[r, a:b], lambda s: dv[r, s, a:b], BT, 1, cols)
        for i in range(2):
            combine(block[2 * a + i:2 * b:2], BT[:, i], lambda r: half[r, a:b])
        if b == rows:
            block[2 * rows:] = 0

    def second(a, b):
        for i in range(2, 4):
            combine(block[2 * a + i:2 * b + i:2], BT[:, i], lambda r: half[r, a:b],
                    accumulate=True)
        done = 0 if a == 0 else 2 * a + 2
        add_back(block[done:2 * b + 2], target, 2 * t0 - layer.pad[0] + done,
                 -layer.pad[1], whole)
    for work in (first, second):
        cpu_threads.split_rows(rows, half[0, 0].size * 4, work)


# ---- the layer's passes -------------------------------------------------------------------
def _tile_shape(layer, chunk, channels):
    """(4, 4, tile rows, tile cols, images, ``channels``) of a chunk's transforms."""
    n0, n1, t0, t1 = chunk
    return (4, 4, t1 - t0, tiles(layer)[1], n1 - n0, channels)


def _buffers(layer, chunk, name, channels):
    return scratch(name, _tile_shape(layer, chunk, channels), layer.dtype)


def _per_group(array, groups):
    """(16, G, tiles, channels / G) view of a chunk's (4, 4, ..., channels) array."""
    return array.reshape(16, -1, groups, array.shape[-1] // groups).swapaxes(1, 2)


def _accumulate_products(a, b, out):
    """``out[f, g] += a[f, g] @ b[f, g]``, each product on one thread."""
    cells = list(np.ndindex(*out.shape[:2]))

    def work(start, stop):
        for cell in cells[start:stop]:
            out[cell] += a[cell] @ b[cell]
    cpu_threads.split(len(cells), work)


def _in_slots(slots, shape):
    """A (4, 4, ...) array of ``shape`` whose frequency f starts slot f of ``slots``
    (16 rows, each as wide as V's and M's frequencies)."""
    return slots[:, :math.prod(shape[2:])].reshape(shape)


def _products_over_tiles(u, v, m, groups):
    """``m`` = ``v`` U, where each frequency of ``m`` shares a slot with that of ``v``
    (``_in_slots``): each thread's products go into a buffer first, then over the
    frequency of ``v`` they used."""
    v, m = _per_group(v, groups), _per_group(m, groups)

    def work(start, stop):
        product = scratch('per group', m.shape[1:], m.dtype)
        for f in range(start, stop):
            cpu_threads.batched_matmul(v[f], u[f].swapaxes(1, 2), out=product)
            m[f] = product
    wide = m.size * v.shape[-1] >= cpu_threads.PARALLEL_GEMM_MIN_FLOPS
    cpu_threads.split(16, work, parts=None if wide else 1)


def forward(layer, x4, y3):
    """``y3`` (N, K, OH*OW) = the convolution of ``x4`` (N, C, H, W), bias included.
    Several chunks run on several threads at once, each in its own buffers (fewer
    waits for each other than splitting every pass); a chunk alone splits its passes."""
    u = _weights(layer)
    y4 = y3.reshape(y3.shape[:2] + tuple(layer.out_spatial))
    todo = chunks(layer)

    def run(first, last):
        for chunk in todo[first:last]:
            n0, n1, t0, t1 = chunk
            slots = _buffers(layer, chunk, 'columns',
                             max(layer.channels, layer.num_output)).reshape(16, -1)
            v, m = (_in_slots(slots, _tile_shape(layer, chunk, channels))
                    for channels in (layer.channels, layer.num_output))
            _input_tiles(layer, x4, chunk, v)
            _products_over_tiles(u, v, m, layer.group)
            if layer.bias_term:     # A^T M A adds M[1, 1] to each of a tile's four outputs
                m[1, 1] += layer.blobs[1].data
            target = y4[n0:n1, :, 2 * t0:2 * t1].transpose(2, 3, 0, 1)
            cpu_threads.split_rows(t1 - t0, m[0, 0, 0].size * 16,
                                   lambda a, b: _output_tiles(m, target, a, b))
    cpu_threads.split(len(todo), run, parts=len(todo))


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
            _accumulate_products(_per_group(dm, g).swapaxes(2, 3), _per_group(v, g), du)
        if dx4 is not None:
            if t0 == 0 and t1 < tiles(layer)[0]:      # the first of its bands
                dx4[n0:n1] = 0
            cpu_threads.batched_matmul(_per_group(dm, g), u, out=_per_group(v, g))
            _input_gradient(layer, v, dx4, chunk)
    if du is not None:
        cpu_threads.matmul(du.reshape(16, -1).T, KRON_G.astype(du.dtype),
                           out=weight_grad.reshape(-1, 9), accumulate=True)
