"""Batch normalization's host engine (numpy), block by block (see array.py for the
engine's four functions).

The arithmetic of the array engine (array.py), but each pass walks the (N*C, S) rows of an
(N, C, S) array a cache-sized block at a time, split over cpu_threads, and writes into
the arrays it is given, so no temporary of the blob's size exists and the several
operations of a pass find their block in the cache. Per-channel sums are taken per row
in the work dtype (sums of products by einsum, which makes no temporary) and added up
in float64.

x_hat, where the backward needs it, is either kept (the layer runs in place, so its
input is gone) or made again from the input block by block: see ``XHat``.

Half blobs (float16, bfloat16: mixed precision) are read and written in the blob dtype, and
each block is computed in float32 (``_in_work_dtype``), then rounded once into its output.
"""
import numpy as np

from ...backend import cpu_threads
from ..neuron.layers import relu, relu_gradient
from .array import STAT, pack, rebase_sums, work_dtype


def _rows(a3):
    return a3.reshape(a3.shape[0] * a3.shape[1], a3.shape[2])     # -1 fails on 0 positions


def _tiled(vector, images, dtype):
    """A per-channel vector repeated for every image: one value per row, as a column.
    (np.tile takes longer than the pass it serves at batch 1.)"""
    vector = np.asarray(vector)
    if images == 1:
        return vector.astype(dtype).reshape(-1, 1)
    tiled = np.empty((images, vector.size), dtype)
    tiled[...] = vector
    return tiled.reshape(-1, 1)


def _blocks(a3, work):
    cpu_threads.blocks(np, a3.shape[0] * a3.shape[1], a3.shape[2], work, a3.dtype.itemsize)


def _in_work_dtype(out, use):
    """Where a pass computes the block ``out``: ``out`` itself, or for a half blob a float32
    block of this thread's scratch (``use`` names it), which ``_store`` rounds into ``out``."""
    if out.dtype == work_dtype(out.dtype):
        return out
    return cpu_threads.scratch_array(use, out.shape, work_dtype(out.dtype))


def _store(block, out):
    if block is not out:
        out[...] = block


def _channel_sums(row_sums, a3):
    """Per-row sums of an (N, C, S) array added up per channel."""
    return row_sums.reshape(a3.shape[:2]).sum(axis=0, dtype=STAT)


class Normalization:
    """x_hat = ((x - K) - (mean - K)) * inv_std with K the mean in the work dtype, as
    array.x_hat_of computes it, one block of rows at a time."""

    def __init__(self, x3, mean, inv_std, dtype):
        images = x3.shape[0]
        shift = mean.astype(dtype)
        residual = (mean - shift.astype(STAT)).astype(dtype)
        self.shift = _tiled(shift, images, dtype)
        self.residual = _tiled(residual, images, dtype) if residual.any() else None
        self.inv_std = _tiled(inv_std.astype(dtype), images, dtype)

    def into(self, x, out, r0, r1):
        """x_hat of the rows [r0, r1) of ``x`` (N*C, S) into ``out``."""
        np.subtract(x, self.shift[r0:r1], out=out)
        if self.residual is not None:
            out -= self.residual[r0:r1]
        out *= self.inv_std[r0:r1]
        return out


class FromOutput:
    """x_hat = (p - beta) / gamma from a chain's output y (chain.py): p = y where
    y > 0, y / s elsewhere (s: the ReLU's negative slope; None: no ReLU; 0: p = y, whose
    x_hat only meets a zero gradient where y <= 0)."""

    def __init__(self, y3, gamma, beta, activation):
        images, dtype = y3.shape[0], work_dtype(y3.dtype)
        self.activation = dtype.type(activation) if activation else None
        self.beta = None if gamma is None else _tiled(beta, images, dtype)
        self.inv_gamma = None if gamma is None else _tiled(1.0 / gamma, images, dtype)

    def into(self, y, out, r0, r1):
        out[...] = y
        if self.activation is not None:
            np.divide(out, self.activation, out=out, where=out <= 0)
        if self.beta is not None:
            out -= self.beta[r0:r1]
            out *= self.inv_gamma[r0:r1]
        return out


class XHat:
    """Where the backward finds x_hat: a kept copy, or an array (the input, or a chain's
    output) and what makes x_hat of it, block by block."""

    def __init__(self, kept=None, x3=None, normalization=None):
        self.kept, self.x3, self.normalization = kept, x3, normalization

    def block(self, r0, r1):
        if self.kept is not None:
            return _rows(self.kept)[r0:r1]
        x = _rows(self.x3)[r0:r1]
        return self.normalization.into(x, np.empty(x.shape, work_dtype(x.dtype)), r0, r1)


def local_sums(x3, reference=None):
    """Sums of (x - shift) and (x - shift)^2 per channel (float64) about the shift, this
    batch's mean rounded to the work dtype, moved to ``reference`` when given."""
    images, channels, _ = x3.shape
    count = images * x3.shape[2]
    dtype = work_dtype(x3.dtype)
    if count == 0:
        zero = np.zeros(channels, STAT)
        return pack(np, 0, zero, zero), zero if reference is None else reference
    x = _rows(x3)
    totals = np.empty(x.shape[0], STAT)

    def add_up(r0, r1):
        totals[r0:r1] = x[r0:r1].sum(axis=1, dtype=dtype)
    _blocks(x3, add_up)
    shift = (_channel_sums(totals, x3) / count).astype(dtype)
    shift_rows = _tiled(shift, images, dtype)
    s1, s2 = np.empty(x.shape[0], STAT), np.empty(x.shape[0], STAT)

    def sums(r0, r1):
        d = np.subtract(x[r0:r1], shift_rows[r0:r1], dtype=dtype)
        s1[r0:r1] = d.sum(axis=1)
        s2[r0:r1] = np.einsum('ij,ij->i', d, d)
    _blocks(x3, sums)
    s1, s2 = _channel_sums(s1, x3), _channel_sums(s2, x3)
    if reference is None:
        return pack(np, count, s1, s2), shift.astype(STAT)
    return pack(np, count, *rebase_sums(count, s1, s2, shift, reference)), reference


def normalize(x3, y3, mean, inv_std, slope=None, bias=None, keep=False, x_hat_out=None,
              activation=None):
    normalization = Normalization(x3, mean, inv_std, work_dtype(x3.dtype))
    kept = x_hat_out if keep else None
    _normalize_rows(x3, y3, normalization, slope, bias, kept, activation)
    if not keep:
        return None
    return XHat(kept, None if kept is not None else x3, normalization)


def _normalize_rows(x3, y3, normalization, slope, bias, kept, activation):
    x, y = _rows(x3), _rows(y3)
    images = x3.shape[0]
    dtype = work_dtype(y3.dtype)
    slope = None if slope is None else _tiled(slope, images, dtype)
    bias = None if bias is None else _tiled(bias, images, dtype)
    kept = None if kept is None else _rows(kept)

    def work(r0, r1):
        out = _in_work_dtype(y[r0:r1], 'norm output')
        normalization.into(x[r0:r1], out, r0, r1)
        if kept is not None:
            kept[r0:r1] = out
        if slope is not None:
            out *= slope[r0:r1]
            out += bias[r0:r1]
        if activation is not None:
            relu(np, out, activation, out)
        _store(out, y[r0:r1])
    _blocks(x3, work)


def output_from_x_hat(x_hat, y3, slope, bias, activation):
    y = _rows(y3)
    images, dtype = y3.shape[0], work_dtype(y3.dtype)
    slope = None if slope is None else _tiled(slope, images, dtype)
    bias = None if bias is None else _tiled(bias, images, dtype)

    def work(r0, r1):
        out = _in_work_dtype(y[r0:r1], 'norm output')
        out[...] = x_hat.block(r0, r1)
        if slope is not None:
            out *= slope[r0:r1]
            out += bias[r0:r1]
        if activation is not None:
            relu(np, out, activation, out)
        _store(out, y[r0:r1])
    _blocks(y3, work)


def x_hat_from_output(y3, gamma, beta, activation):
    return XHat(None, y3, FromOutput(y3, gamma, beta, activation))


def activation_gradient(y3, dy3, activation, x_hat):
    if activation is None:
        return dy3
    y, dy = _rows(y3), _rows(dy3)

    def work(r0, r1):
        relu_gradient(np, y[r0:r1], dy[r0:r1], activation, dy[r0:r1])
    _blocks(dy3, work)
    return dy3


def gradient_sums(dy3, x_hat):
    dy = _rows(dy3)
    sum_dy, sum_dy_x_hat = np.empty(dy.shape[0], STAT), np.empty(dy.shape[0], STAT)

    dtype = work_dtype(dy3.dtype)

    def work(r0, r1):
        block = dy[r0:r1]
        sum_dy[r0:r1] = block.sum(axis=1, dtype=dtype)
        if x_hat is not None:
            sum_dy_x_hat[r0:r1] = np.einsum('ij,ij->i', x_hat.block(r0, r1), block, dtype=dtype)
    _blocks(dy3, work)
    return (_channel_sums(sum_dy, dy3),
            None if x_hat is None else _channel_sums(sum_dy_x_hat, dy3))


def input_gradient(dx3, dy3, scale, x_hat=None, sum_dy=None, sum_dy_x_hat=None, count=None):
    dx, dy = _rows(dx3), _rows(dy3)
    images, dtype = dy3.shape[0], work_dtype(dx3.dtype)
    per_row = _tiled(scale, images, dtype)
    if sum_dy is not None:
        m = np.maximum(count, 1)
        along_x_hat = _tiled(scale * sum_dy_x_hat / m, images, dtype)
        constant = _tiled(scale * sum_dy / m, images, dtype)

    def work(r0, r1):
        x_hat_block = x_hat.block(r0, r1) if sum_dy is not None else None
        out = _in_work_dtype(dx[r0:r1], 'norm input gradient')
        np.multiply(dy[r0:r1], per_row[r0:r1], out=out)
        if sum_dy is not None:
            out -= x_hat_block * along_x_hat[r0:r1]
            out -= constant[r0:r1]
        _store(out, dx[r0:r1])
    _blocks(dy3, work)
