"""Convolution's GEMMs on the host (numpy), one of the host engine's passes (host.py): the
columns of one chunk at a time, in reused buffers; a 1x1 convolution's image is its own
column matrix, one GEMM per image and group.

A chunk is as many images as fill about COLUMN_BYTES of columns or, when one image's
columns are larger, a band of output rows of one image. Its columns are written into a
buffer of the calling thread that serves every layer, laid out
``(C, *kernel, images, *output positions)``, where each image's GEMM reads its own
columns and writes its output straight into the top, or, for narrow outputs, with the
images last, ``(C, *kernel, *output positions, images)``, where one GEMM per group
covers the chunk and its output is copied into the top: each kernel offset's copy then
runs over long contiguous rows, which numpy copies far faster than rows of a few values.
The columns and their gradients go to and from the image in host_columns.py.

The backward makes the columns again instead of keeping them (they are K times the
input), so memory holds one chunk's columns per thread, not a net's. Weight gradients
accumulate into the param diff without a temporary of its size. Units of whole images
(all the bands of one image) run on several threads at once, each thread with its own
buffers; each part of the units sums its weight gradient apart, and the parts are added
in order, so results do not depend on which thread ran what. A unit that runs alone
splits its GEMMs and copies over the threads instead.
"""
import math

import numpy as np

from ...backend import cpu_threads
from .host_columns import add_columns_to_image, columns, offset_major, padded_columns, \
    padded_top, scratch, writes_images

#: about how many bytes of columns one chunk makes
COLUMN_BYTES = 2 << 20
#: ... but at least this many output positions, so that its GEMMs stay wide, as long as
#: that takes no more than MAX_COLUMN_BYTES (and one row of outputs in any case)
MIN_POSITIONS = 512
MAX_COLUMN_BYTES = 16 << 20
#: outputs narrower than this put the images last in the columns of a chunk
NARROW = 16
#: above this many groups, the groups of an accumulating GEMM go to numpy's batched matmul
FEW_GROUPS = 4
#: weight gradients of at least this many positions per GEMM may be taken as their
#: transpose (see _transposed)
TRANSPOSED_MIN_POSITIONS = 256
#: a backward runs its units on several threads when the batch has at least this many
#: output positions: each thread's own weight-gradient sum costs about as much as that
#: many positions' share of the GEMMs it parallelizes
PARTIAL_SUM_MIN_POSITIONS = 256


class Chunk:
    """Images [first, last) and, along the first output axis, rows [row, row_end)."""

    def __init__(self, first, last, row, row_end, layer):
        self.first, self.last, self.row, self.row_end = first, last, row, row_end
        self.images = last - first
        self.images_last = self.images > 1 and layer.out_spatial[-1] < NARROW
        self.out_shape = (row_end - row,) + tuple(layer.out_spatial[1:])
        rest = int(math.prod(layer.out_spatial[1:]))
        self.positions = (row_end - row) * rest          # per image
        self.columns = slice(row * rest, row_end * rest)
        s, d, k = layer.stride[0], layer.dilation[0], layer.kernel[0]
        self.rows_in = (row * s, (row_end - 1) * s + d * (k - 1) + 1)   # of the padded input

    def order(self, array):
        """``array`` (images, C, ...) viewed as (C, ...) with the images where the
        chunk's columns have them."""
        return np.moveaxis(array, 0, -1) if self.images_last else array.swapaxes(0, 1)

    def shape(self, leading, spatial):
        """The shape (*leading, images and spatial axes in the chunk's order)."""
        images = (self.images,)
        return leading + (spatial + images if self.images_last else images + spatial)

    def cells(self, spatial):
        """An index of a (C, images and spatial axes) array by spatial slices."""
        every = (slice(None),)
        return every + (spatial + every if self.images_last else every + spatial)


def chunks(layer, kernel_rows):
    """The chunks of a forward or backward over ``layer``'s batch; ``kernel_rows`` is
    the number of rows of its column matrix (C/G * K for every group, stacked)."""
    out = layer.out_spatial
    rows, rest = out[0], int(math.prod(out[1:]))
    itemsize = np.dtype(layer.dtype).itemsize
    budget = max(COLUMN_BYTES, min(MAX_COLUMN_BYTES, kernel_rows * MIN_POSITIONS * itemsize))
    per_row = kernel_rows * rest * itemsize
    if per_row * rows <= budget:
        # ... and images enough for every thread to take two chunks
        step = max(1, min(budget // (per_row * rows),
                          -(-layer.batch // (2 * cpu_threads.threads()))))
        return [Chunk(n, min(layer.batch, n + step), 0, rows, layer)
                for n in range(0, layer.batch, step)]
    band = max(1, budget // per_row)
    return [Chunk(n, n + 1, r, min(rows, r + band), layer)
            for n in range(layer.batch) for r in range(0, rows, band)]


# ---- GEMMs --------------------------------------------------------------------------------
def grouped_gemm(a, b, out, accumulate=False):
    """``out[g] = a[g] @ b[g]`` (or +=) for each group g of 3-D operands."""
    if not accumulate:
        cpu_threads.batched_matmul(a, b, out=out)
        return
    if a.shape[0] <= FEW_GROUPS:     # in place, in cache-sized pieces (cpu_threads.matmul)
        for g in range(a.shape[0]):
            cpu_threads.matmul(a[g], b[g], out=out[g], accumulate=True)
        return

    def work(g0, g1):
        out[g0:g1] += np.matmul(a[g0:g1], b[g0:g1])
    cpu_threads.split(a.shape[0], work)


def _transposed(dy, cols):
    """Whether a weight gradient is taken as its transpose, cols @ dy^T: with more column
    rows than outputs, the BLAS runs it up to twice as fast (16 x 144 from 1024 positions:
    65 against 131 us), but adding it to the gradient then reads it across, about 1 ns a
    value, which only enough positions pay for (64 x 576 from 64: 13 us saved, 40 spent)."""
    return cols.shape[-2] > dy.shape[-2] and dy.shape[-1] >= TRANSPOSED_MIN_POSITIONS


def add_weight_gradient(dy, cols, gradient):
    """``gradient`` (G, O, K) += ``dy`` (G, O, P) @ ``cols`` (G, K, P)^T."""
    if _transposed(dy, cols):
        grouped_gemm(cols, dy.swapaxes(1, 2), gradient.swapaxes(1, 2), accumulate=True)
    else:
        grouped_gemm(dy, cols.swapaxes(1, 2), gradient, accumulate=True)


def add_weight_gradients(dy, cols, gradient):
    """``add_weight_gradient`` of each image's ``dy`` (images, G, O, P) and ``cols``
    (images, G, K, P): the products in one batched GEMM, then added to ``gradient`` image
    after image, in the order of one call per image."""
    transposed = _transposed(dy, cols)
    left, right = (cols, dy) if transposed else (dy, cols)
    products = scratch('weight products', left.shape[:3] + (right.shape[2],), gradient.dtype)
    cpu_threads.batched_matmul(left, right.swapaxes(2, 3), out=products)
    target = gradient.swapaxes(1, 2) if transposed else gradient
    products[0] += target
    np.add.reduce(products, axis=0, out=target)


def _image_matrix(array, chunk, image, groups):
    """Image ``image`` of the chunk in ``array`` (N, G * rows, P), as (G, rows, positions)."""
    return array[chunk.first + image, :, chunk.columns].reshape(groups, -1, chunk.positions)


def _image_matrices(array, chunk, groups):
    """The chunk's images in ``array`` (N, G * rows, P), as (images, G, rows, positions)."""
    return array[chunk.first:chunk.last, :, chunk.columns].reshape(
        chunk.images, groups, -1, chunk.positions)


def _batched(weight, chunk):
    """Whether the per-image GEMMs of a chunk with its images first go to one batched call:
    when they are too small to split over threads (a Python call per GEMM costs as much as
    LeNet's first convolution's 20 x 25 by 25 x 576) and their weight-gradient products
    fit a column buffer."""
    return (not chunk.images_last and chunk.images > 1
            and weight.size * chunk.positions < cpu_threads.PARALLEL_GEMM_MIN_FLOPS
            and weight.nbytes * chunk.images <= COLUMN_BYTES)


def _gathered(array, chunk, groups):
    """The chunk's images of ``array`` (N, G * rows, P), images last, as (G, rows,
    positions * images) in a scratch buffer."""
    rows = array.shape[1]
    gathered = scratch('per group', (rows, chunk.positions, chunk.images), array.dtype)
    source = chunk.order(array[chunk.first:chunk.last, :, chunk.columns])

    def gather(r0, r1):
        gathered[r0:r1] = source[r0:r1]
    cpu_threads.split_rows(rows, gathered[0].size, gather)
    return gathered.reshape(groups, rows // groups, -1)


def _images_in_parallel(count, work, weight_grad=None, positions=0):
    """``work(a, b, gradient)`` over ``count`` units of images (units hold disjoint
    images), in parts split over threads. ``gradient`` is where a part adds its weight
    gradient: the param diff for the first part, a zeroed buffer of the caller's for each
    other one, added to the diff in part order at the end, so the sums are the same
    whichever thread ran which part. A batch with few positions for the size of its
    weight gradient runs as one part (its GEMMs are split instead)."""
    # two parts a thread balance a late start; one, when each part costs a gradient buffer
    parts = min(count, (1 if weight_grad is not None else 2) * cpu_threads.threads())
    if cpu_threads.threads() == 1 or (weight_grad is not None
                                      and positions < PARTIAL_SUM_MIN_POSITIONS):
        parts = 1
    if parts <= 1:
        work(0, count, weight_grad)
        return
    bounds = [count * p // parts for p in range(parts + 1)]
    gradients = [weight_grad] + [
        None if weight_grad is None else
        scratch('weight gradient %d' % p, weight_grad.shape, weight_grad.dtype)
        for p in range(1, parts)]

    def run(p0, p1):
        for p in range(p0, p1):
            if p and gradients[p] is not None:
                gradients[p][...] = 0
            work(bounds[p], bounds[p + 1], gradients[p])
    cpu_threads.split(parts, run, parts=parts)
    for gradient in gradients[1:]:
        if gradient is not None:
            weight_grad += gradient


def _units(layer, kernel_rows):
    """The chunks in runs that share their images: the bands of one image, which add into
    the same rows of dx, stay on one thread."""
    units = []
    for chunk in chunks(layer, kernel_rows):
        if units and units[-1][-1].first == chunk.first:
            units[-1].append(chunk)
        else:
            units.append([chunk])
    return units


def forward(layer, x, y):
    """``y`` (N, O, P) = the convolution of ``x`` (N, C, *spatial), bias included. With
    the images first in the columns, each image's GEMM writes into y directly; with the
    images last, one GEMM covers the chunk and its output is copied into y."""
    if layer.pointwise:
        pointwise_forward(layer, _matrices(x), y)
        return
    weight = layer.grouped_weight()
    g, outputs_per_group, kernel_rows = weight.shape
    units = _units(layer, g * kernel_rows)

    def run(a, b, _):
        for chunk in (chunk for unit in units[a:b] for chunk in unit):
            cols = columns(layer, x, chunk)
            if not chunk.images_last:
                cols = cols.reshape(g, kernel_rows, chunk.images, chunk.positions)
                if _batched(weight, chunk):
                    cpu_threads.batched_matmul(weight, cols.transpose(2, 0, 1, 3),
                                               out=_image_matrices(y, chunk, g))
                    continue
                for i in range(chunk.images):
                    grouped_gemm(weight, cols[:, :, i], _image_matrix(y, chunk, i, g))
                continue
            out = scratch('per group', (g * outputs_per_group, chunk.positions, chunk.images),
                          y.dtype)
            grouped_gemm(weight, cols.reshape(g, kernel_rows, -1),
                         out.reshape(g, outputs_per_group, -1))
            target = chunk.order(y[chunk.first:chunk.last])
            cpu_threads.split_rows(g * outputs_per_group, out[0].size,
                                   lambda r0, r1: np.copyto(target[r0:r1], out[r0:r1]))
    _images_in_parallel(len(units), run)
    if layer.bias_term:
        add_channel_vector(y, layer.blobs[1].data)


def backward(layer, x, dy, dx, weight_grad):
    """Accumulate the weight gradient into ``weight_grad`` (grouped like the weights, or
    None) and write ``dx`` (N, C, *spatial, or None) from ``dy`` (N, O, P)."""
    if layer.pointwise:
        pointwise_backward(layer, _matrices(x), dy, None if dx is None else _matrices(dx),
                           weight_grad)
        return
    weight = layer.grouped_weight()
    g, outputs_per_group, kernel_rows = weight.shape
    units = _units(layer, g * kernel_rows)
    by_offset = offset_major(layer, weight) if dx is not None and any(
        padded_columns(layer, chunk) for unit in units for chunk in unit) else None

    def run(a, b, gradient):
        for chunk in (chunk for unit in units[a:b] for chunk in unit):
            batched = _batched(weight, chunk)
            if chunk.images_last:        # (G, rows, positions * images) matrices, one GEMM each
                top = [_gathered(dy, chunk, g)]
            elif batched:                # (images, G, rows, positions), one batched GEMM
                top = _image_matrices(dy, chunk, g)
            else:                        # one per image
                top = [_image_matrix(dy, chunk, i, g) for i in range(chunk.images)]
            pieces = len(top)
            if weight_grad is not None:
                cols = columns(layer, x, chunk).reshape(g, kernel_rows, pieces, -1)
                if batched:
                    add_weight_gradients(top, cols.transpose(2, 0, 1, 3), gradient)
                for i, dy_piece in enumerate([] if batched else top):
                    add_weight_gradient(dy_piece, cols[:, :, i], gradient)
            if dx is not None:
                if chunk.row == 0 and not writes_images(layer, chunk):
                    dx[chunk.first:chunk.last] = 0
                padded = padded_columns(layer, chunk)
                source, positions = weight, chunk.positions
                if padded:
                    top = padded_top(layer, dy, chunk)
                    source, positions = by_offset, top.shape[-1]
                    top = top if batched else list(top)
                dcols = scratch('columns', (g, kernel_rows, pieces,
                                            chunk.images * positions // pieces), dy.dtype)
                if batched:
                    cpu_threads.batched_matmul(source.swapaxes(1, 2), top,
                                               out=dcols.transpose(2, 0, 1, 3))
                for i, dy_piece in enumerate([] if batched else top):
                    grouped_gemm(source.swapaxes(1, 2), dy_piece, dcols[:, :, i])
                add_columns_to_image(layer, dcols, dx, chunk, padded)
    _images_in_parallel(len(units), run, weight_grad, layer.batch * dy.shape[2])


# ---- 1x1 convolutions: the image is its own column matrix ---------------------------------
def _matrices(image):
    """``image`` (N, C, *spatial) as (N, C, positions)."""
    return image.reshape(image.shape[:2] + (int(math.prod(image.shape[2:])),))   # N may be 0


def pointwise_forward(layer, x3, y3):
    """``x3`` (N, C, P) -> ``y3`` (N, O, P), one GEMM per image and group."""
    weight = layer.grouped_weight()
    g = layer.group

    def run(a, b, _):
        for n in range(a, b):
            grouped_gemm(weight, x3[n].reshape(g, -1, x3.shape[2]),
                         y3[n].reshape(g, -1, y3.shape[2]))
    _images_in_parallel(layer.batch, run)
    if layer.bias_term:
        add_channel_vector(y3, layer.blobs[1].data)


def pointwise_backward(layer, x3, dy3, dx3, weight_grad):
    weight = layer.grouped_weight()
    g = layer.group
    def run(a, b, gradient):
        for n in range(a, b):
            dy = dy3[n].reshape(g, -1, dy3.shape[2])
            if weight_grad is not None:
                add_weight_gradient(dy, x3[n].reshape(g, -1, x3.shape[2]), gradient)
            if dx3 is not None:
                grouped_gemm(weight.swapaxes(1, 2), dy, dx3[n].reshape(g, -1, dx3.shape[2]))
    _images_in_parallel(layer.batch, run, weight_grad, layer.batch * dy3.shape[2])


# ---- per-channel vectors ------------------------------------------------------------------
def add_channel_vector(y, vector):
    """``y`` (N, C, ...) += ``vector`` (C,) along axis 1, in place."""
    n, c = y.shape[:2]
    if y.size == 0:
        return
    rows = y.reshape(n * c, -1)
    per_row = np.tile(vector.astype(y.dtype, copy=False), n).reshape(-1, 1)

    def add(r0, r1):
        rows[r0:r1] += per_row[r0:r1]
    cpu_threads.split_rows(n * c, rows.shape[1], add)
