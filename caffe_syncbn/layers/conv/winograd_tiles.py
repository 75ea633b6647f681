"""The tile transforms of Winograd F(2x2, 3x3) (host_winograd.py), as passes over strided
views of numpy arrays whose first axes are tile cells.

B^T and A^T hold only 0 and +-1, so a transform is additions and subtractions of views,
each pass along the contiguous values behind one cell (images * channels in a chunk);
``adjoint`` runs a transform backward, adding where the tiles overlap. ``fill`` and
``add_back`` move a chunk's block of padded cells in and out of an image.
"""
import numpy as np

BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]])
G = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]])
AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]])
#: G w G^T of a kernel w is KRON_G @ w.reshape(9): row 4 r + s, column 3 a + b
KRON_G = np.kron(G, G)


def combine(out, coefficients, term, accumulate=False):
    """``out`` (+)= sum_i coefficients[i] * term(i), for coefficients 0 and +-1; a sum
    of two terms is written in one pass."""
    terms = [(k, i) for i, k in enumerate(coefficients) if k]
    if not accumulate:
        (k, i), terms = terms[0], terms[1:]
        if terms and k > 0:
            (k1, i1), terms = terms[0], terms[1:]
            (np.add if k1 > 0 else np.subtract)(term(i), term(i1), out=out)
        elif terms and terms[0][0] > 0:
            (_, i1), terms = terms[0], terms[1:]
            np.subtract(term(i1), term(i), out=out)
        elif k > 0:
            np.copyto(out, term(i))
        else:
            np.negative(term(i), out=out)
    for k, i in terms:
        (np.add if k > 0 else np.subtract)(out, term(i), out=out)


def along(array, axis, index):
    """``array[..., index, ...]`` with ``index`` on ``axis``."""
    return array[(slice(None),) * (axis % array.ndim) + (index,)]


def tile_cells(array, axis, j, count):
    """Cell j of each of ``count`` 4-cell tiles at steps of 2 along ``axis``."""
    return along(array, axis, slice(j, j + 2 * count, 2))


def transform(out, source, matrix, axis):
    """out[r] = sum_j matrix[r, j] * (cell j of each tile of ``source`` along ``axis``),
    for the rows r of ``matrix``; ``source`` holds 2 * tiles + 2 cells along ``axis``."""
    count = out.shape[1:][axis]
    for r in range(matrix.shape[0]):
        combine(out[r], matrix[r], lambda j: tile_cells(source, axis, j, count))


def adjoint(target, term, matrix, axis, count):
    """The adjoint of ``transform``: ``target`` (2 * count + 2 cells along ``axis``) =
    sum_j cell j of each tile <- sum_r matrix[r, j] * term(r), tiles overlapping."""
    for j in range(matrix.shape[1]):
        cells = tile_cells(target, axis, j, count)
        if j < 2:                    # the first two cells of each tile are written first
            combine(cells, matrix[:, j], term)
        else:
            if j == 2:
                along(target, axis, slice(2 * count, 2 * count + 2))[...] = 0
            combine(cells, matrix[:, j], term, accumulate=True)


def fill(block, source, row, col):
    """``block`` (rows, cols, ...) = the cells of ``source`` (H, W, ...) from (row, col)
    on, zero outside it."""
    rows, cols = block.shape[:2]
    h, w = source.shape[:2]
    r0, r1 = min(rows, max(0, -row)), max(0, min(rows, h - row))
    c0, c1 = min(cols, max(0, -col)), max(0, min(cols, w - col))
    for index in (np.s_[:r0], np.s_[max(r0, r1):], np.s_[:, :c0], np.s_[:, max(c0, c1):]):
        block[index] = 0
    if r1 > r0 and c1 > c0:
        block[r0:r1, c0:c1] = source[row + r0:row + r1, col + c0:col + c1]


def add_back(block, target, row, col, whole):
    """``target`` (H, W, ...) += the cells of ``block`` that fall inside it, ``block``
    starting at (row, col); ``whole``: the block covers the target, which it sets."""
    rows, cols = block.shape[:2]
    h, w = target.shape[:2]
    r0, r1 = max(0, -row), min(rows, h - row)
    c0, c1 = max(0, -col), min(cols, w - col)
    if whole:
        target[row + r0:row + r1, col + c0:col + c1] = block[r0:r1, c0:c1]
    elif r1 > r0 and c1 > c0:
        target[row + r0:row + r1, col + c0:col + c1] += block[r0:r1, c0:c1]
