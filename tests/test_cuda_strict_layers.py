"""The grid-stride kernels of cuda/pooling.cu, lrn.cu, interp.cu, comm_sum.cu, loss.cu and
conv.cu, launched directly through the strict emulation against float64 numpy: odd
sizes, grids smaller than the work, blocks of 32, 96 and 1024, pointers one element off
16-byte alignment, float16 (where the kernel has it), float32 and float64."""
import math

import numpy as np
import pytest

from helpers.cuda_emulation import kernel, schedule
from test_cuda_strict_syncbn import SUFFIX, assert_close, device, nan_filled

#: relative error of an output rounded to the storage type after float32/64 arithmetic
TOL = {np.float16: 1.5e-3, np.float32: 3e-6, np.float64: 1e-13}
DTYPES = [np.float16, np.float32, np.float64]
#: (grid, block): one small block for all the work, several, one full block
LAUNCHES = [((1,), (32,)), ((2,), (96,)), ((3,), (1024,))]


def i32(v):
    return np.int32(v)


def k(stem, name, dtype):
    return kernel(stem, '%s_%s' % (name, SUFFIX[dtype]))


# ---- pooling -----------------------------------------------------------------------------

def pooled_size(size, k_, s, p):
    out = int(math.ceil((size + 2 * p - k_) / s)) + 1
    if p > 0 and (out - 1) * s >= size + p:
        out -= 1
    return out


def pool_reference(x, k_, s, p, kind):
    nc, h, w = x.shape
    oh, ow = pooled_size(h, k_[0], s[0], p[0]), pooled_size(w, k_[1], s[1], p[1])
    y, index, divisor = np.zeros((nc, oh, ow)), np.zeros((nc, oh, ow), int), np.zeros((oh, ow))
    for i in range(oh):
        for j in range(ow):
            h0, w0 = i * s[0] - p[0], j * s[1] - p[1]
            h1, w1 = min(h0 + k_[0], h + p[0]), min(w0 + k_[1], w + p[1])
            divisor[i, j] = (h1 - h0) * (w1 - w0)
            h0, w0, h1, w1 = max(h0, 0), max(w0, 0), min(h1, h), min(w1, w)
            window = x[:, h0:h1, w0:w1].reshape(nc, -1)
            if kind == 'max':
                best = window.argmax(1)
                y[:, i, j] = window.max(1)
                index[:, i, j] = (h0 + best // (w1 - w0)) * w + w0 + best % (w1 - w0)
            else:
                y[:, i, j] = window.sum(1) / divisor[i, j]
    return y, index, divisor


#: (NC, H, W), kernel, stride, pad: odd sizes, a ceil-rounded last window, a 1x1 image, and
#: a 16x16 window whose float16 sum needs a float32 accumulator
POOLS = [((3, 7, 5), (3, 3), (2, 2), (1, 1)), ((1, 1, 1), (1, 1), (1, 1), (0, 0)),
         ((2, 17, 16), (16, 16), (1, 1), (0, 0)), ((2, 6, 9), (2, 3), (2, 3), (0, 1))]


def pool_args(g, k_, s, p, oh, ow):
    nc, h, w = g
    return [i32(v) for v in (nc, h, w, oh, ow, k_[0], k_[1], s[0], s[1], p[0], p[1])]


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('geometry', POOLS)
@pytest.mark.parametrize('launch', LAUNCHES)
@pytest.mark.parametrize('misaligned', [False, True])
def test_max_pooling(dtype, geometry, launch, misaligned):
    shape, k_, s, p = geometry
    rs = np.random.RandomState(0)
    x = device(rs.permutation(np.prod(shape)).reshape(shape) / 8 + 1, dtype, misaligned)
    want, want_index, _ = pool_reference(x.astype(np.float64), k_, s, p, 'max')
    oh, ow = want.shape[1:]
    y, index = nan_filled(want.shape, dtype, misaligned), np.full(want.shape, -1, np.int32)
    args = pool_args(shape, k_, s, p, oh, ow)
    k('pooling', 'pool_max_forward', dtype)(*launch, [x] + args + [y, index])
    assert (y.astype(np.float64) == want).all()
    assert (index == want_index).all()
    dy = device(rs.standard_normal(want.shape), dtype)
    dx = nan_filled(shape, dtype, not misaligned)
    k('pooling', 'pool_max_backward', dtype)(*launch, [dy, index] + args + [dx])
    want_dx = np.zeros(shape)
    for n in range(shape[0]):
        np.add.at(want_dx[n].reshape(-1), want_index[n].reshape(-1),
                  dy[n].astype(np.float64).reshape(-1))
    assert_close(dx, want_dx, TOL[dtype], 'max dx')


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('geometry', POOLS)
@pytest.mark.parametrize('launch', LAUNCHES)
@pytest.mark.parametrize('misaligned', [False, True])
def test_ave_pooling(dtype, geometry, launch, misaligned):
    shape, k_, s, p = geometry
    rs = np.random.RandomState(1)
    x = device(rs.uniform(1, 2, shape), dtype, misaligned)
    want, _, divisor = pool_reference(x.astype(np.float64), k_, s, p, 'ave')
    oh, ow = want.shape[1:]
    y = nan_filled(want.shape, dtype, not misaligned)
    args = pool_args(shape, k_, s, p, oh, ow)
    k('pooling', 'pool_ave_forward', dtype)(*launch, [x] + args + [y])
    assert_close(y, want, TOL[dtype], 'ave y')
    dy = device(rs.uniform(1, 2, want.shape), dtype, misaligned)
    dx = nan_filled(shape, dtype)
    k('pooling', 'pool_ave_backward', dtype)(*launch, [dy] + args + [dx])
    want_dx = np.zeros(shape)
    g = dy.astype(np.float64) / divisor
    for i in range(oh):
        for j in range(ow):
            h0, w0 = max(i * s[0] - p[0], 0), max(j * s[1] - p[1], 0)
            h1, w1 = min(i * s[0] - p[0] + k_[0], shape[1]), min(j * s[1] - p[1] + k_[1], shape[2])
            want_dx[:, h0:h1, w0:w1] += g[:, i, j][:, None, None]
    assert_close(dx, want_dx, TOL[dtype], 'ave dx')


def test_max_pooling_ties_pick_the_first():
    """Equal values in a window: the first in row-major order is the maximum (Caffe's rule)."""
    shape, k_, s, p = (2, 7, 6), (3, 3), (2, 1), (1, 1)
    x = device(np.random.RandomState(31).randint(0, 3, shape), np.float32)
    want, want_index, _ = pool_reference(x.astype(np.float64), k_, s, p, 'max')
    oh, ow = want.shape[1:]
    y, index = nan_filled(want.shape, np.float32), np.full(want.shape, -1, np.int32)
    k('pooling', 'pool_max_forward', np.float32)((1,), (32,), [x] + pool_args(shape, k_, s, p, oh, ow)
                                                 + [y, index])
    assert (index == want_index).all() and (y == want).all()


def test_max_pooling_backward_float16_sums_in_float32():
    """A peak that 25 windows choose: its float16 gradient is their float32 sum, rounded once;
    likewise AVE's sums over 25 windows."""
    shape, k_, s, p = (1, 9, 9), (5, 5), (1, 1), (2, 2)
    values = np.zeros(shape)
    values[0, 4, 4] = 1
    _, index64, _ = pool_reference(values, k_, s, p, 'max')
    index = index64.astype(np.int32)
    dy = device(np.random.RandomState(32).uniform(1, 2, index.shape), np.float16)
    dx = nan_filled(shape, np.float16)
    k('pooling', 'pool_max_backward', np.float16)((1,), (96,), [dy, index] + pool_args(
        shape, k_, s, p, *index.shape[1:]) + [dx])
    want = np.zeros(81)
    np.add.at(want, index.reshape(-1), dy.astype(np.float64).reshape(-1))
    assert (dx.reshape(-1) == want.astype(np.float16)).all()
    # AVE: every cell sums dy/25 over up to 25 windows; within one float16 step of the truth
    dx = nan_filled(shape, np.float16)
    k('pooling', 'pool_ave_backward', np.float16)((1,), (96,), [dy] + pool_args(
        shape, k_, s, p, *index.shape[1:]) + [dx])
    want = np.zeros(shape)
    g = dy.astype(np.float64) / 25
    for i in range(9):
        for j in range(9):
            want[0, max(i - 2, 0):i + 3, max(j - 2, 0):j + 3] += g[0, i, j]
    step = np.spacing(want.astype(np.float16)).astype(np.float64)
    assert (np.abs(dx.astype(np.float64) - want) <= step).all()


# ---- LRN ---------------------------------------------------------------------------------

def lrn_window(v, size):
    """sum of v over the `size` channels centred on each channel (zero outside)."""
    half = (size - 1) // 2
    c = v.shape[1]
    out = np.zeros_like(v)
    for ch in range(c):
        out[:, ch] = v[:, max(ch - half, 0):min(ch + half, c - 1) + 1].sum(1)
    return out


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape, size', [((2, 37, 5), 5), ((1, 3, 257), 3), ((1, 1, 1), 5),
                                         ((3, 4, 2), 7)])
@pytest.mark.parametrize('launch', LAUNCHES)
@pytest.mark.parametrize('misaligned', [False, True])
def test_lrn(dtype, shape, size, launch, misaligned):
    n, c, hw = shape
    alpha, beta, k0 = 1.5, 0.75, 2.0
    rs = np.random.RandomState(2)
    x = device(rs.uniform(-3, 3, shape), dtype, misaligned)
    x64 = x.astype(np.float64)
    want_scale = k0 + alpha / size * lrn_window(x64 * x64, size)
    scale, y = nan_filled(shape, dtype), nan_filled(shape, dtype, not misaligned)
    k('lrn', 'lrn_across_forward', dtype)(*launch, (
        x, i32(n), i32(c), np.int64(hw), i32(size), np.float64(alpha / size), np.float64(beta),
        np.float64(k0), scale, y))
    assert_close(scale, want_scale, TOL[dtype], 'scale')
    assert_close(y, x64 * want_scale ** -beta, TOL[dtype], 'y')
    dy = device(rs.standard_normal(shape), dtype, misaligned)
    dx = nan_filled(shape, dtype)
    ratio = 2 * alpha * beta / size
    k('lrn', 'lrn_across_backward', dtype)(*launch, (
        x, y, scale, dy, i32(n), i32(c), np.int64(hw), i32(size), np.float64(ratio),
        np.float64(beta), dx))
    s64, y64, g = scale.astype(np.float64), y.astype(np.float64), dy.astype(np.float64)
    want = g * s64 ** -beta - ratio * x64 * lrn_window(g * y64 / s64, size)
    assert_close(dx, want, TOL[dtype] * 4, 'dx')


def test_lrn_float16_window_keeps_float32():
    """Large channels first, then small ones: a window summed in float16 keeps the rounding
    of the large squares after they left, far above float16's rounding of the output."""
    shape, size, alpha, beta, k0 = (1, 37, 5), 7, 10.0, 0.75, 2.0
    rs = np.random.RandomState(30)
    values = rs.uniform(-0.1, 0.1, shape)
    values[:, :4] = rs.uniform(2, 3, (1, 4, 5))
    x = device(values, np.float16)
    x64 = x.astype(np.float64)
    want = k0 + alpha / size * lrn_window(x64 * x64, size)
    scale, y = nan_filled(shape, np.float16), nan_filled(shape, np.float16)
    k('lrn', 'lrn_across_forward', np.float16)((1,), (32,), (
        x, i32(1), i32(37), np.int64(5), i32(size), np.float64(alpha / size), np.float64(beta),
        np.float64(k0), scale, y))
    assert_close(scale, want, TOL[np.float16], 'scale')
    assert_close(y, x64 * want ** -beta, TOL[np.float16], 'y')
    # backward: large gradients on the large channels, small ones after
    grads = rs.uniform(0.05, 0.1, shape)
    grads[:, :4] = 5000
    dy, dx = device(grads, np.float16), nan_filled(shape, np.float16)
    ratio = 2 * alpha * beta / size
    k('lrn', 'lrn_across_backward', np.float16)((1,), (32,), (
        x, y, scale, dy, i32(1), i32(37), np.int64(5), i32(size), np.float64(ratio),
        np.float64(beta), dx))
    s64, y64, g = scale.astype(np.float64), y.astype(np.float64), dy.astype(np.float64)
    want = g * s64 ** -beta - ratio * x64 * lrn_window(g * y64 / s64, size)
    assert_close(dx, want, TOL[np.float16] * 2, 'dx', scale=np.abs(want) + 1e-2)


# ---- Interp ------------------------------------------------------------------------------

def taps(out_size, in_size):
    """The fork's float32 sampling: (first, second, weight of second) per output index."""
    ratio = np.float32(in_size - 1) / np.float32(out_size - 1) if out_size > 1 else np.float32(0)
    src = (ratio * np.arange(out_size, dtype=np.float32)).astype(np.float32)
    first = src.astype(np.int64)
    second = np.minimum(first + 1, in_size - 1)
    return first, second, (src - first.astype(np.float32)).astype(np.float64)


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('geometry', [(3, 5, 7, 1, 3, 4, 9, 13), (2, 4, 4, 0, 4, 4, 1, 1),
                                      (1, 9, 6, 2, 5, 2, 5, 3)])
@pytest.mark.parametrize('launch', LAUNCHES)
@pytest.mark.parametrize('order', ['forward', 'reverse'])
def test_interp(dtype, geometry, launch, order):
    nc, h, w, b, ih, iw, oh, ow = geometry
    rs = np.random.RandomState(3)
    x = device(rs.standard_normal((nc, h, w)), dtype, True)
    outside = np.ones((h, w), bool)
    outside[b:b + ih, b:b + iw] = False
    x[:, outside] = np.nan                   # the crop: a read of these shows
    y = nan_filled((nc, oh, ow), dtype)
    args = [i32(v) for v in geometry]
    with schedule(order):
        k('interp', 'interp_forward', dtype)(*launch, [x] + args + [y])
    r0, r1, lh = taps(oh, ih)
    c0, c1, lw = taps(ow, iw)
    crop = x.astype(np.float64)[:, b:b + ih, b:b + iw]
    hh, ww = (1 - lh)[:, None], (1 - lw)[None, :]
    want = hh * (ww * crop[:, r0][:, :, c0] + lw * crop[:, r0][:, :, c1]) \
        + lh[:, None] * (ww * crop[:, r1][:, :, c0] + lw * crop[:, r1][:, :, c1])
    assert_close(y, want, TOL[dtype], 'y')
    dy = device(rs.standard_normal((nc, oh, ow)), dtype)
    dx = device(np.zeros((nc, h, w)), dtype, True)
    with schedule(order):
        k('interp', 'interp_backward', dtype)(*launch, [dy] + args + [dx])
    want_dx = np.zeros((nc, h, w))
    g = dy.astype(np.float64)
    for i in range(oh):
        for j in range(ow):
            for rr, wr in ((r0[i], 1 - lh[i]), (r1[i], lh[i])):
                for cc, wc in ((c0[j], 1 - lw[j]), (c1[j], lw[j])):
                    want_dx[:, b + rr, b + cc] += wr * wc * g[:, i, j]
    assert_close(dx, want_dx, TOL[dtype] * 4, 'dx')


# ---- the same-device allreduce -----------------------------------------------------------

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('n', [1, 257, 64])
@pytest.mark.parametrize('nsrc, accumulate', [(1, 0), (3, 0), (8, 0), (8, 1), (2, 1)])
@pytest.mark.parametrize('launch, misaligned', [(LAUNCHES[0], None), (LAUNCHES[1], 'dst'),
                                                (LAUNCHES[2], 'src')])
def test_reduce_sum8(dtype, n, nsrc, accumulate, launch, misaligned):
    rs = np.random.RandomState(4)
    values = rs.uniform(-2, 2, (9, n))
    srcs = [device(values[i], dtype, misaligned == 'src' and i == nsrc - 1) for i in range(nsrc)]
    dst = device(values[8], dtype, misaligned == 'dst') if accumulate else \
        nan_filled(n, dtype, misaligned == 'dst')
    acc = np.float64 if dtype == np.float64 else np.float32
    want = dst.astype(acc) if accumulate else srcs[0].astype(acc)
    for s in srcs[0 if accumulate else 1:]:
        want = want + s.astype(acc)
    pointers = srcs + [None] * (8 - nsrc)
    k('comm_sum', 'reduce_sum8', dtype)(*launch, pointers + [i32(nsrc), i32(accumulate), dst,
                                                           np.int64(n)])
    assert (dst == want.astype(dtype)).all()
    copy = nan_filled(n, dtype, misaligned == 'src')
    k('comm_sum', 'reduce_copy', dtype)(*launch, (dst, copy, np.int64(n)))
    assert (copy == dst).all()


# ---- SoftmaxWithLoss ---------------------------------------------------------------------

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('outer, classes, inner', [(2, 3, 257), (1, 1, 1), (3, 5, 4)])
@pytest.mark.parametrize('launch', LAUNCHES)
@pytest.mark.parametrize('misaligned', [False, True])
def test_softmax_loss(dtype, outer, classes, inner, launch, misaligned):
    rs = np.random.RandomState(5)
    scores = device(rs.standard_normal((outer, classes, inner)) * 3, dtype, misaligned)
    labels64 = rs.randint(0, classes, (outer, inner)).astype(np.float64)
    labels64.reshape(-1)[::7] = 255          # ignored
    if outer * inner > 3:
        labels64.reshape(-1)[3] = classes    # out of range
    labels = device(labels64, dtype, not misaligned)
    acc = np.float64 if dtype == np.float64 else np.float32
    prob = nan_filled(scores.shape, dtype)
    loss, valid = nan_filled(labels.shape, acc), nan_filled(labels.shape, acc)
    args = [i32(outer), i32(classes), np.int64(inner), i32(1), i32(255)]
    k('loss', 'softmax_loss_forward', dtype)(*launch, [scores, labels] + args
                                                     + [prob, loss, valid])
    s = scores.astype(np.float64)
    e = np.exp(s - s.max(1, keepdims=True))
    want_prob = e / e.sum(1, keepdims=True)
    assert_close(prob, want_prob, TOL[dtype], 'prob')
    lab = labels64.astype(int)
    ok = (lab >= 0) & (lab < classes)
    want_valid = np.where(labels64 == 255, 0, np.where(ok, 1, -1))
    assert (valid == want_valid).all()
    picked = np.take_along_axis(prob.astype(np.float64), np.clip(lab, 0, classes - 1)[:, None], 1)[:, 0]
    want_loss = np.where(want_valid == 1, -np.log(np.maximum(picked, 1.17549435e-38)), 0)
    assert_close(loss, want_loss, 1e-6 if dtype != np.float64 else 1e-13, 'loss')
    top = device([0.5], np.float64)            # the loss weight (times a loss scale)
    dx = nan_filled(scores.shape, dtype, misaligned)
    k('loss', 'softmax_loss_backward', dtype)(*launch, [prob, labels] + args
                                                      + [top, np.array([3.0]), dx])
    onehot = (np.arange(classes)[None, :, None] == lab[:, None, :])
    want_dx = (prob.astype(np.float64) - onehot) * 0.5 / 3.0 * (want_valid == 1)[:, None, :]
    assert_close(dx, want_dx, TOL[dtype], 'dx')


def test_softmax_float16_sums_in_float32():
    """40 classes of similar scores: each probability within float16 rounding of the truth,
    which a float16 running sum of the exponentials misses."""
    outer, classes, inner = 2, 40, 3
    rs = np.random.RandomState(33)
    scores = device(rs.uniform(0, 0.5, (outer, classes, inner)), np.float16)
    labels = device(np.zeros((outer, inner)), np.float16)
    prob = nan_filled(scores.shape, np.float16)
    loss, valid = nan_filled(labels.shape, np.float32), nan_filled(labels.shape, np.float32)
    k('loss', 'softmax_loss_forward', np.float16)((1,), (32,), [
        scores, labels, i32(outer), i32(classes), np.int64(inner), i32(0), i32(-1), prob, loss,
        valid])
    e = np.exp(scores.astype(np.float64))
    want = e / e.sum(1, keepdims=True)
    assert_close(prob, want, 1e-3, 'prob', scale=want)


# ---- im2col ------------------------------------------------------------------------------

#: (N, C, H, W, KH, KW, PH, PW, SH, SW, DH, DW): the 4th has cells whose last window starts
#: at OH*SH (col2im's guard), the 5th 25 windows over a cell (a float16 sum needs float32)
IM2COL = [(2, 3, 7, 5, 3, 3, 1, 1, 2, 1, 1, 2), (1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1),
          (1, 2, 9, 8, 2, 3, 2, 0, 1, 3, 2, 1), (1, 2, 8, 6, 3, 3, 1, 0, 2, 2, 1, 1),
          (1, 2, 9, 9, 5, 5, 2, 2, 1, 1, 1, 1)]


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('geometry', IM2COL)
@pytest.mark.parametrize('launch', LAUNCHES)
@pytest.mark.parametrize('misaligned', [False, True])
def test_im2col_col2im(dtype, geometry, launch, misaligned):
    n, c, h, w, kh, kw, ph, pw, sh, sw, dh, dw = geometry
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (w + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    rs = np.random.RandomState(6)
    x = device(rs.standard_normal((n, c, h, w)), dtype, misaligned)
    padded = np.zeros((n, c, h + 2 * ph, w + 2 * pw))
    padded[:, :, ph:ph + h, pw:pw + w] = x.astype(np.float64)
    want = np.zeros((n, c, kh, kw, oh, ow))
    for i in range(kh):
        for j in range(kw):
            want[:, :, i, j] = padded[:, :, i * dh:i * dh + sh * oh:sh, j * dw:j * dw + sw * ow:sw]
    col = nan_filled(want.shape, dtype, not misaligned)
    args = [i32(v) for v in (n, c, h, w, kh, kw, ph, pw, sh, sw, dh, dw, oh, ow)]
    k('conv', 'im2col', dtype)(*launch, [x] + args + [col])
    assert (col.astype(np.float64) == want).all()
    cols = device(rs.standard_normal(want.shape), dtype, misaligned)
    back = nan_filled(x.shape, dtype)
    k('conv', 'col2im', dtype)(*launch, [cols] + args + [back])
    padded = np.zeros((n, c, h + 2 * ph, w + 2 * pw))
    for i in range(kh):
        for j in range(kw):
            padded[:, :, i * dh:i * dh + sh * oh:sh, j * dw:j * dw + sw * ow:sw] += \
                cols.astype(np.float64)[:, :, i, j]
    assert_close(back, padded[:, :, ph:ph + h, pw:pw + w], TOL[dtype], 'col2im')
