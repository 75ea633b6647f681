"""Index arithmetic past 2^31 and 2^32 elements, for the kernels whose sizes are 64-bit (SyncBN,
the same-device reduce, LRN, SoftmaxWithLoss, the fused kernels, the Jaccard matrix) or whose
item counts and in-plane offsets are 64-bit products (pooling, im2col, Interp, box decoding). The arrays are sparse mappings
(MAP_NORESERVE: untouched pages read as the shared zero page and cost no memory); the test
writes a few values near the end, runs only the last blocks of the full-size grid (the
emulation's `blocks=`) and checks their outputs, and that the cells 2^32 elements before them,
where a wrapped 32-bit index would land, stay zero."""
import mmap

import numpy as np
import pytest

from helpers.cuda_emulation import kernel
from test_cuda_strict_detection import TOL as DETECTION_TOL
from test_cuda_strict_detection import (CENTER_SIZE, box_set, random_priors, reference_decode,
                                        reference_jaccard)
from test_cuda_strict_syncbn import SUFFIX, assert_close

MAP_NORESERVE = 0x4000  # <sys/mman.h> on Linux; Python's mmap module does not name it
WRAP = 2 ** 32


def sparse(shape, dtype):
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    try:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
    except OSError as error:
        pytest.skip('no %d GiB sparse mapping here: %s' % (size >> 30, error))
    return np.frombuffer(region, dtype).reshape(shape)


def last_blocks(grid, count=2):
    return [(grid - 1 - b, 0, 0) for b in range(count)]


def fill(array, start, stop, seed):
    """Random values in array.flat[start:stop] (only those pages get memory)."""
    flat = array.reshape(-1)
    flat[start:stop] = np.random.RandomState(seed).uniform(-2, 2, stop - start)
    return flat[start:stop].astype(np.float64)


@pytest.mark.parametrize('hw', [2 ** 31 + 5, 2 ** 31 + 8])   # scalar path, 8-wide vectors
def test_syncbn_normalize_and_dx(hw):
    n, c, dtype = 1, 3, np.float16
    total = n * c * hw
    width = 8 if hw % 8 == 0 else 1
    grid = -(-total // width // 256)
    x, y, dy, dx = (sparse((n, c, hw), dtype) for _ in range(4))
    first = (grid - 2) * 256 * width
    xs, gs = fill(x, first, total, 1), fill(dy, first, total, 2)
    params = np.array([0.5, 1.0, -1.0, 0, 0, 0, 1, 2, 4, 1, -2, 3, 0.25, 0.5, 1], np.float32)
    channel = np.arange(first, total) // hw % c
    mean, invstd, scale, bias = (params[3 * p:3 * p + 3][channel].astype(np.float64)
                                 for p in (0, 2, 3, 4))
    kernel('norm', 'syncbn_normalize_f16')((grid,), (256,), (
        x, y, None, params, np.int64(c), np.int64(hw), np.int64(total)), blocks=last_blocks(grid))
    assert_close(y.reshape(-1)[first:], (xs - mean) * scale + bias, 2e-3, 'y')
    assert not y.reshape(-1)[first - WRAP:total - WRAP].any()
    sums, count = np.array([1.0, 2.0, -3.0, 0.5, -1.0, 2.0]), np.array([4.0])
    kernel('norm', 'syncbn_backward_dx_f16')((grid,), (256,), (
        x, dy, dx, params, np.int32(0), sums, count, np.int64(c), np.int64(hw), np.int64(total)),
        blocks=last_blocks(grid))
    xhat = (xs - mean) * invstd
    want = scale * (gs - sums[channel] / 4 - xhat * sums[3 + channel] / 4)
    assert_close(dx.reshape(-1)[first:], want, 8e-3, 'dx')
    assert not dx.reshape(-1)[first - WRAP:total - WRAP].any()


@pytest.mark.parametrize('name', ['local_stats', 'backward_reduce'])
def test_syncbn_channel_slices(name):
    """N*HW < 2^31 per channel, but channel 2 starts past 2^32."""
    n, c, hw, splits = 1, 3, 2 ** 31 - 1, 2 ** 20
    x, dy = sparse((n, c, hw), np.float32), sparse((n, c, hw), np.float32)
    b = splits - 1
    begin, end = n * hw * b // splits, n * hw * (b + 1) // splits
    offset = 2 * hw
    xs, gs = fill(x, offset + begin, offset + end, 3), fill(dy, offset + begin, offset + end, 4)
    x.reshape(-1)[offset] = 7                       # channel 2's pivot
    partial = np.full(c * splits * 2, np.nan)
    params = np.array([0, 0, 0.5, 0, 0, 0, 1, 1, 2, 1, 1, 1, 0, 0, 0], np.float32)
    if name == 'local_stats':
        pivot = np.full(c, np.nan)
        args = (x, np.int32(n), np.int32(c), np.int64(hw), np.int32(splits), partial, pivot)
        want = (xs - 7).sum(), ((xs - 7) ** 2).sum()
    else:
        args = (x, dy, params, np.int32(0), np.int32(n), np.int32(c), np.int64(hw),
                np.int32(splits), partial)
        want = gs.sum(), (gs * (xs - 0.5) * 2).sum()
    # block (0, 2) writes the pivot; its slice holds zeros and the pivot
    kernel('norm', 'syncbn_%s_f32' % name)((splits, c), (256,), args,
                                             blocks=[(b, 2, 0), (0, 2, 0)])
    slot = (2 * splits + b) * 2
    assert_close(partial[slot:slot + 2], want, 1e-5, name, scale=np.abs(gs).sum() * 8 + 1)
    if name == 'local_stats':
        assert pivot[2] == 7


def test_reduce_sum8_and_copy():
    n = WRAP + 24
    grid = -(-n // 8 // 256)
    a, b, dst = (sparse(n, np.float16) for _ in range(3))
    first = (grid - 2) * 256 * 8
    av, bv, dv = fill(a, first, n, 5), fill(b, first, n, 6), fill(dst, first, n, 7)
    # accumulate: an element added twice (a stride that wrapped at 2^32) shows
    kernel('comm_sum', 'reduce_sum8_f16')((grid,), (256,), [a, b] + [None] * 6 + [
        np.int32(2), np.int32(1), dst, np.int64(n)], blocks=last_blocks(grid))
    want = (dv.astype(np.float32) + av.astype(np.float32) + bv.astype(np.float32))
    assert (dst[first:] == want.astype(np.float16)).all()
    assert not dst[first - WRAP:n - WRAP].any()
    kernel('comm_sum', 'reduce_copy_f16')((grid,), (256,), (dst, a, np.int64(n)),
                                        blocks=last_blocks(grid))
    assert (a[first:] == dst[first:]).all()


def test_lrn():
    """N*HW columns past 2^32: the second image's last columns."""
    n, c, hw = 2, 3, 2 ** 31 + 3
    grid = -(-n * hw // 256)
    x, scale, y = (sparse((n, c, hw), np.float32) for _ in range(3))
    first = (grid - 2) * 256 - hw             # a column of image 1
    cols = [fill(x, (c + ch) * hw + first, (c + ch + 1) * hw, 7 + ch) for ch in range(c)]
    kernel('lrn', 'lrn_across_forward_f32')((grid,), (256,), (
        x, np.int32(n), np.int32(c), np.int64(hw), np.int32(3), np.float64(1.0), np.float64(0.5),
        np.float64(2.0), scale, y), blocks=last_blocks(grid))
    sq = [v * v for v in cols]
    want = [2 + sq[0] + sq[1], 2 + sq[0] + sq[1] + sq[2], 2 + sq[1] + sq[2]]
    for ch in range(c):
        assert_close(scale[1, ch, first:], want[ch], 1e-6, 'scale')
        assert_close(y[1, ch, first:], cols[ch] * want[ch] ** -0.5, 1e-6, 'y')


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_softmax_loss(dtype):
    outer, classes, inner = 1, 3, 2 ** 31 + 7
    scores, prob, dx = (sparse((outer, classes, inner), dtype) for _ in range(3))
    labels = sparse((outer, inner), dtype)
    acc = np.float64 if dtype == np.float64 else np.float32
    loss, valid = sparse((outer, inner), acc), sparse((outer, inner), acc)
    grid = -(-inner // 256)
    first = (grid - 3) * 256                   # wide enough for backward's last blocks too
    s = np.stack([fill(scores, k * inner + first, (k + 1) * inner, 9 + k) for k in range(classes)])
    labels[0, first:] = np.arange(inner - first) % classes
    args = [np.int32(outer), np.int32(classes), np.int64(inner), np.int32(0), np.int32(-1)]
    kernel('loss', 'softmax_loss_forward_' + SUFFIX[dtype])(
        (grid,), (256,), [scores, labels] + args + [prob, loss, valid],
        blocks=last_blocks(grid, 3))
    e = np.exp(s - s.max(0))
    p = e / e.sum(0)
    lab = np.arange(inner - first) % classes
    assert_close(prob[0, :, first:], p, 1e-6, 'prob')
    assert_close(loss[0, first:], -np.log(p[lab, np.arange(lab.size)]), 1e-6, 'loss')
    assert (valid[0, first:] == 1).all()
    total = classes * inner
    grid = -(-total // 256)
    top = np.array([1.0])
    kernel('loss', 'softmax_loss_backward_' + SUFFIX[dtype])(
        (grid,), (256,), [prob, labels] + args + [top, np.array([1.0]), dx],
        blocks=last_blocks(grid))
    tail = total - (grid - 2) * 256            # the last blocks cover class 2's tail
    want = p[2, -tail:] - (lab[-tail:] == 2)
    assert_close(dx[0, 2, inner - tail:], want, 1e-6, 'dx')
    assert not dx.reshape(-1)[total - tail - WRAP:total - WRAP].any()


def test_softmax_loss_outer_times_classes_past_2_31():
    """inner = 1: outer*classes itself passes 2^31 (computed in 64 bits, not int)."""
    outer, classes = 2 ** 20, 2 ** 11 + 1
    total = outer * classes
    prob, dx = sparse((outer, classes, 1), np.float32), sparse((outer, classes, 1), np.float32)
    labels = np.arange(outer, dtype=np.float32) % classes
    grid = -(-total // 256)
    first = (grid - 2) * 256
    ps = fill(prob, first, total, 20)
    args = [np.int32(outer), np.int32(classes), np.int64(1), np.int32(0), np.int32(-1)]
    kernel('loss', 'softmax_loss_backward_f32')(
        (grid,), (256,), [prob, labels] + args + [np.array([2.0]), np.array([4.0]), dx],
        blocks=last_blocks(grid))
    t = np.arange(first, total)
    want = (ps - (t % classes == labels[t // classes])) * 0.5
    assert_close(dx.reshape(-1)[first:], want, 1e-6, 'dx')


def test_pooling_and_im2col_item_counts():
    """int sizes whose products (items, plane offsets) pass 2^32."""
    nc, h, w = 2 ** 22 + 1, 32, 32
    items = nc * h * w
    x, y = sparse((nc, h, w), np.float16), sparse((nc, h, w), np.float16)
    index = sparse((nc, h, w), np.int32)
    grid = -(-items // 256)
    first = (grid - 2) * 256
    xs = fill(x, first, items, 12)
    pool = [np.int32(v) for v in (nc, h, w, h, w, 1, 1, 1, 1, 0, 0)]
    kernel('pooling', 'pool_max_forward_f16')((grid,), (256,), [x] + pool + [y, index],
                                              blocks=last_blocks(grid))
    assert (y.reshape(-1)[first:].astype(np.float64) == xs).all()
    assert (index.reshape(-1)[first:] == np.arange(first, items) % (h * w)).all()
    assert not y.reshape(-1)[first - WRAP:items - WRAP].any()
    for name, args in (('pool_max_backward', [y, index]), ('pool_ave_forward', [x]),
                       ('pool_ave_backward', [x])):
        out = sparse((nc, h, w), np.float16)
        kernel('pooling', name + '_f16')((grid,), (256,), args + pool + [out],
                                         blocks=last_blocks(grid))
        assert (out.reshape(-1)[first:].astype(np.float64) == xs).all(), name
        assert not out.reshape(-1)[first - WRAP:items - WRAP].any(), name
    col = sparse((nc, h, w), np.float16)
    geometry = [np.int32(v) for v in (1, nc, h, w, 1, 1, 0, 0, 1, 1, 1, 1, h, w)]
    kernel('conv', 'im2col_f16')((grid,), (256,), [x] + geometry + [col], blocks=last_blocks(grid))
    assert (col.reshape(-1)[first:].astype(np.float64) == xs).all()
    assert not col.reshape(-1)[first - WRAP:items - WRAP].any()
    back = sparse((nc, h, w), np.float16)
    kernel('conv', 'col2im_f16')((grid,), (256,), [col] + geometry + [back],
                                   blocks=last_blocks(grid))
    assert (back.reshape(-1)[first:].astype(np.float64) == xs).all()
    out = sparse((nc, h, w), np.float32)
    x32 = sparse((nc, h, w), np.float32)
    xs32 = fill(x32, first, items, 13)
    interp = [np.int32(v) for v in (nc, h, w, 0, h, w, h, w)]
    kernel('interp', 'interp_forward_f32')((grid,), (256,), [x32] + interp + [out],
                                           blocks=last_blocks(grid))
    assert_close(out.reshape(-1)[first:], xs32, 1e-6, 'interp')
    assert not out.reshape(-1)[first - WRAP:items - WRAP].any()


def test_im2col_and_interp_planes_past_2_31():
    """One image plane of more than 2^31 cells: the in-plane offsets (row * W, kernel offset *
    plane) are 64-bit. (Pooling's are not: its MAX index is int32, so H*W < 2^31 is its
    contract.)"""
    h, w = 3, 2 ** 30 + 3
    ow = w - 1                                 # KW = 2: two column planes
    plane = h * ow
    grid = -(-plane // 256)
    first = (grid - 2) * 256
    x, back = sparse((1, 1, h, w), np.float16), sparse((1, 1, h, w), np.float16)
    col = sparse((1, 1, 1, 2, h, ow), np.float16)
    fill(x, h * w - 4 * 256, h * w, 14)
    geometry = [np.int32(v) for v in (1, 1, h, w, 1, 2, 0, 0, 1, 1, 1, 1, h, ow)]
    kernel('conv', 'im2col_f16')((grid,), (256,), [x] + geometry + [col], blocks=last_blocks(grid))
    rows, cols = np.divmod(np.arange(first, plane), ow)
    for kw in range(2):
        assert (col[0, 0, 0, kw, rows, cols] == x[0, 0, rows, cols + kw]).all()
    cells = h * w
    grid = -(-cells // 256)
    kernel('conv', 'col2im_f16')((grid,), (256,), [col] + geometry + [back],
                                   blocks=last_blocks(grid))
    rows, cols = np.divmod(np.arange((grid - 2) * 256, cells), w)
    c0 = col[0, 0, 0, 0, rows, np.minimum(cols, ow - 1)].astype(np.float64) * (cols < ow)
    c1 = col[0, 0, 0, 1, rows, np.maximum(cols - 1, 0)].astype(np.float64) * (cols >= 1)
    assert_close(back[0, 0, rows, cols], c0 + c1, 1e-3, 'col2im')
    # Interp with a crop of 2, rows 4 -> 7 (output row 5 samples input rows 2 and 3 half and
    # half: row offsets 2W and 3W pass 2^31), columns kept; the fork's float32 sampling rounds
    # a column past 2^24 to a float: source column = float32(column)
    h, b = 8, 2
    ih, iw, oh = 4, w - 2 * b, 7
    x, dx = sparse((1, h, w), np.float32), sparse((1, h, w), np.float32)
    y = sparse((1, oh, iw), np.float32)
    grid = -(-oh * iw // 256)
    block = (5 * iw + 3 * iw // 4) // 256
    columns = np.arange(block * 256, block * 256 + 512) - 5 * iw
    assert columns[0] > 2 ** 29
    source = columns.astype(np.float32).astype(np.int64)
    for row in (2, 3):
        x[0, b + row, b + source[0]:b + source[-1] + 1] = np.random.RandomState(row).uniform(
            -2, 2, source[-1] - source[0] + 1)
    geometry = [np.int32(v) for v in (1, h, w, b, ih, iw, oh, iw)]
    blocks = [(block, 0, 0), (block + 1, 0, 0)]
    kernel('interp', 'interp_forward_f32')((grid,), (256,), [x] + geometry + [y], blocks=blocks)
    want = 0.5 * x[0, b + 2, b + source].astype(np.float64) + 0.5 * x[0, b + 3, b + source]
    assert_close(y[0, 5, columns], want, 1e-6, 'interp y')
    kernel('interp', 'interp_backward_f32')((grid,), (256,), [y] + geometry + [dx], blocks=blocks)
    for row in (2, 3):
        want = np.zeros(w)
        np.add.at(want, b + source, 0.5 * y[0, 5, columns].astype(np.float64))
        assert_close(dx[0, b + row, b + source[0]:b + source[-1] + 1],
                     want[b + source[0]:b + source[-1] + 1], 1e-6, 'interp dx')


@pytest.mark.parametrize('name', ['affine_relu', 'bn_relu_forward', 'bn_relu_backward_dx',
                                  'eltwise_sum_relu', 'eltwise_sum_relu_backward'])
def test_fused_elementwise(name):
    n, c, hw = 1, 3, 2 ** 31 + 5
    total = n * c * hw
    grid = -(-total // 256)
    first = (grid - 2) * 256
    x, dy, out = (sparse((n, c, hw), np.float16) for _ in range(3))
    xs, gs = fill(x, first, total, 16), fill(dy, first, total, 17)
    a, b = np.array([1, 2, -3], np.float32), np.array([0.5, -1, 0.25], np.float32)
    gamma, beta = np.array([1, -2, 0.5], np.float16), np.array([0, 1, -0.5], np.float16)
    params = np.array([0.5, 1, -1, 0, 0, 0, 1, 2, 4, 1, -4, 2, 0, 1, -0.5], np.float32)
    sums, count = np.array([1.0, 2.0, -3.0, 0.5, -1.0, 2.0]), np.array([4.0])
    slope = 0.1
    size = [np.int64(c), np.int64(hw), np.int64(total)]
    # every value near the end is in channel 2
    pre = {'affine_relu': -3 * xs + 0.25, 'bn_relu_forward': (xs + 1) * 2 - 0.5}
    if name == 'affine_relu':
        args = [x, a, b] + size + [np.int32(1), np.float64(slope), out]
    elif name == 'bn_relu_forward':
        args = [x, params] + size + [np.float64(slope), out]
    elif name == 'bn_relu_backward_dx':
        args = [x, dy, gamma, beta, np.float64(slope), params, sums, count] + size + [out]
        on = xs > 0
        g = np.where(on, gs, slope * gs)
        xhat = (np.where(on, xs, xs / slope) + 0.5) / 0.5
        want = 2 * (g - sums[2] / 4 - xhat * sums[5] / 4)
    elif name == 'eltwise_sum_relu':
        args = [x, dy, np.float64(2), np.float64(-1), np.int64(total), np.float64(slope), out]
        pre[name] = 2 * xs - gs
    else:
        args = [x, dy, np.float64(-2), np.int64(total), np.float64(slope), out]
        want = -2 * np.where(xs > 0, gs, slope * gs)
    stem = 'eltwise' if name.startswith('eltwise') else 'norm'
    kernel(stem, 'fused_%s_f16' % name)((grid,), (256,), args, blocks=last_blocks(grid))
    if name in pre:
        want = np.where(pre[name] > 0, pre[name], slope * pre[name])
    assert_close(out.reshape(-1)[first:], want, 2e-2, name)
    assert not out.reshape(-1)[first - WRAP:total - WRAP].any()


def test_fused_bn_relu_backward_reduce():
    n, c, hw, splits = 1, 3, 2 ** 31 - 1, 2 ** 20
    y, dy = sparse((n, c, hw), np.float32), sparse((n, c, hw), np.float32)
    b = splits - 1
    begin, end = n * hw * b // splits, n * hw * (b + 1) // splits
    ys, gs = fill(y, 2 * hw + begin, 2 * hw + end, 18), fill(dy, 2 * hw + begin, 2 * hw + end, 19)
    gamma, beta = np.array([1, 1, 2], np.float32), np.array([0, 0, 0.5], np.float32)
    partial = np.full(c * splits * 2, np.nan)
    kernel('norm', 'fused_bn_relu_backward_reduce_f32')((splits, c), (256,), (
        y, dy, gamma, beta, np.float64(0), np.int32(n), np.int32(c), np.int64(hw),
        np.int32(splits), partial), blocks=[(b, 2, 0)])
    on = ys > 0
    g, xhat = np.where(on, gs, 0), (np.where(on, ys, 0) - 0.5) / 2
    slot = (2 * splits + b) * 2
    assert_close(partial[slot:slot + 2], [g.sum(), (g * xhat).sum()], 1e-5, 'sums',
                 scale=np.abs(gs).sum() * 4 + 1)


def test_decode_boxes_past_2_31_boxes():
    """num * P * L and P + p past 2^31: the last two blocks' boxes, from sparse arrays."""
    num, count = 2, 2 ** 30 + 1
    total = num * count
    grid = -(-total // 256)
    loc = sparse((num, count, 1, 4), np.float16)
    prior = sparse((2, count, 4), np.float16)
    boxes = sparse((num, count, 1, 4), np.float32)
    first = (grid - 2) * 256                     # the last blocks' boxes: image 1, last priors
    rs = np.random.RandomState(40)
    loc.reshape(-1, 4)[first:] = rs.standard_normal((total - first, 4))
    tail = first - count
    prior[:, tail:] = random_priors(rs, count - tail)
    kernel('detection', 'decode_boxes_f16')((grid,), (256,), (
        loc, prior, np.int32(num), np.int32(count), np.int32(1), np.int32(CENTER_SIZE),
        np.int32(0), boxes), blocks=last_blocks(grid))
    want = reference_decode(loc[1:, tail:].astype(np.float64),
                            prior[:, tail:].astype(np.float64), CENTER_SIZE, 0)
    assert_close(boxes[1:, tail:], want, DETECTION_TOL[np.float16] * 4, 'boxes')
    assert not boxes.reshape(-1, 4)[first - WRAP // 4:total - WRAP // 4].any()


def test_jaccard_past_2_32_pairs():
    """na * nb past 2^32 pairs: the last two blocks' overlaps, into a sparse matrix."""
    na, nb = 2 ** 16 + 1, 2 ** 16
    total = na * nb
    grid = -(-total // 256)
    rs = np.random.RandomState(41)
    a = np.tile(box_set(rs, 1), (na, 1))        # every row overlaps every column somewhat
    b = random_priors(rs, nb)[0] * 0.2 + 0.1
    iou = sparse((na, nb), np.float32)
    kernel('detection', 'jaccard_f32')((grid,), (256,), (a.astype(np.float32), np.int64(na),
                                              b.astype(np.float32), np.int64(nb), iou),
                             blocks=last_blocks(grid))
    first = (grid - 2) * 256
    want = reference_jaccard(a[-1:].astype(np.float32).astype(np.float64),
                             b[first % nb:].astype(np.float32).astype(np.float64))
    assert (want > 0).all()
    assert_close(iou[-1, first % nb:], want[0], DETECTION_TOL[np.float32] * 4, 'iou')
    assert not iou.reshape(-1)[first - WRAP:total - WRAP].any()
