"""The detection kernels of cuda/detection.cu (box decoding, the Jaccard matrix), launched
directly through the strict emulation against float64 numpy written here from the fork's
formulas: 1 prior, sizes that are not a multiple of the block, 257, grids smaller than the
work, blocks of 32, 96, 256 and 1024, float16/32/64 (indices past 2^31 boxes and 2^32 pairs:
test_cuda_strict_index64.py). The kernels read scalars only (no vector path), so no
misaligned-pointer cases."""
import numpy as np
import pytest

from helpers.cuda_emulation import kernel
from test_cuda_strict_syncbn import ACC, SUFFIX, assert_close, device, nan_filled

DTYPES = [np.float16, np.float32, np.float64]
#: relative error (to max(1, |value|)) of arithmetic in float32 / float64 on exact inputs
TOL = {np.float16: 2e-6, np.float32: 2e-6, np.float64: 1e-13}
LAUNCHES = [((1,), (32,)), ((2,), (96,)), ((3,), (1024,)), ((64,), (256,))]
CORNER, CENTER_SIZE, CORNER_SIZE = 1, 2, 3
#: (num, priors, location classes): one prior, per-class boxes, 257 priors
DECODE_SHAPES = [(1, 1, 1), (2, 257, 1), (1, 5, 21), (3, 37, 3)]


def k(name, dtype):
    return kernel('detection', '%s_%s' % (name, SUFFIX[dtype]))


def random_priors(rs, count):
    """(2, count, 4): corner boxes around the unit square, then variances 0.1 / 0.2."""
    centre = rs.uniform(-0.1, 1.1, (count, 2))
    size = rs.uniform(0.05, 0.6, (count, 2))
    boxes = np.concatenate([centre - size / 2, centre + size / 2], axis=1)
    variances = np.tile([0.1, 0.1, 0.2, 0.2], (count, 1)) * rs.uniform(0.5, 2, (count, 1))
    return np.stack([boxes, variances])


def reference_decode(loc, prior, code_type, encoded):
    """The fork's DecodeBBox of every (image, prior, class) box, in float64, box by box."""
    num, count, classes = loc.shape[:3]
    out = np.empty(loc.shape)
    for n in range(num):
        for p in range(count):
            xmin, ymin, xmax, ymax = prior[0, p]
            var = np.ones(4) if encoded else prior[1, p]
            width, height = xmax - xmin, ymax - ymin
            for c in range(classes):
                d = loc[n, p, c] * var
                if code_type == CORNER:
                    box = [xmin + d[0], ymin + d[1], xmax + d[2], ymax + d[3]]
                elif code_type == CORNER_SIZE:
                    box = [xmin + d[0] * width, ymin + d[1] * height,
                           xmax + d[2] * width, ymax + d[3] * height]
                else:
                    cx = d[0] * width + (xmin + xmax) / 2
                    cy = d[1] * height + (ymin + ymax) / 2
                    w, h = np.exp(d[2]) * width, np.exp(d[3]) * height
                    box = [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]
                out[n, p, c] = box
    return out


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('shape', DECODE_SHAPES)
@pytest.mark.parametrize('code_type', [CORNER, CENTER_SIZE, CORNER_SIZE])
@pytest.mark.parametrize('encoded', [0, 1])
@pytest.mark.parametrize('grid, block', LAUNCHES)
def test_decode_boxes(dtype, shape, code_type, encoded, grid, block):
    num, count, classes = shape
    rs = np.random.RandomState(30 + count)
    loc = device(rs.standard_normal(shape + (4,)) * (0.5 if encoded else 2), dtype)
    prior = device(random_priors(rs, count), dtype)
    boxes = nan_filled(shape + (4,), ACC[dtype])
    k('decode_boxes', dtype)(grid, block, (loc, prior, np.int32(num), np.int32(count),
                                           np.int32(classes), np.int32(code_type),
                                           np.int32(encoded), boxes))
    want = reference_decode(loc.astype(np.float64), prior.astype(np.float64), code_type, encoded)
    assert_close(boxes, want, TOL[dtype] * 4, 'boxes')


def reference_jaccard(a, b):
    """The fork's JaccardOverlap of every pair, in float64, pair by pair."""
    def size(box):
        return 0.0 if box[2] < box[0] or box[3] < box[1] else (box[2] - box[0]) * (box[3] - box[1])

    out = np.zeros((len(a), len(b)))
    for i, u in enumerate(a):
        for j, v in enumerate(b):
            if v[0] > u[2] or v[2] < u[0] or v[1] > u[3] or v[3] < u[1]:
                continue                                   # disjoint: no intersection box
            inter = [max(u[0], v[0]), max(u[1], v[1]), min(u[2], v[2]), min(u[3], v[3])]
            w, h = inter[2] - inter[0], inter[3] - inter[1]
            if w > 0 and h > 0:
                out[i, j] = w * h / (size(u) + size(v) - w * h)
    return out


def box_set(rs, count):
    """Random boxes, then the special ones while there is room: the unit square twice (IoU
    1), one touching it at an edge (0), one inside it, an inverted box (size 0)."""
    boxes = random_priors(rs, count)[0]
    special = [[0, 0, 0.5, 0.5], [0, 0, 0.5, 0.5], [0.5, 0, 1, 0.5], [0.125, 0.125, 0.25, 0.375],
               [0.75, 0.75, 0.25, 0.25]]
    boxes[:min(count, 5)] = special[:min(count, 5)]
    return boxes


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('sizes', [(1, 1), (257, 3), (5, 257), (33, 7)])
@pytest.mark.parametrize('grid, block', LAUNCHES)
def test_jaccard(dtype, sizes, grid, block):
    rs = np.random.RandomState(sum(sizes))
    a = device(box_set(rs, sizes[0]), dtype)
    b = device(box_set(rs, sizes[1])[::-1].copy(), dtype)
    iou = nan_filled(sizes, ACC[dtype])
    k('jaccard', dtype)(grid, block, (a, np.int64(len(a)), b, np.int64(len(b)), iou))
    want = reference_jaccard(a.astype(np.float64), b.astype(np.float64))
    assert_close(iou, want, TOL[dtype] * 4, 'iou')
    if min(sizes) > 1:        # the special boxes: not a near miss of the tolerance
        assert (want > 0).any() and (want == 0).any()


def test_jaccard_special_pairs():
    """Equal boxes give exactly 1; an edge contact, an inverted box and boxes of no width or
    no height (whose union is 0: no 0/0) exactly 0."""
    boxes = np.array([[0, 0, 0.5, 0.5], [0.5, 0, 1, 0.5], [0.75, 0.75, 0.25, 0.25],
                      [0.125, 0.125, 0.25, 0.375], [0.5, 0, 0.5, 1], [0, 0.5, 1, 0.5]])
    iou = nan_filled((6, 6), np.float64)
    k('jaccard', np.float64)((1,), (32,), (boxes, np.int64(6), boxes, np.int64(6), iou))
    assert iou[0, 0] == 1 and iou[1, 1] == 1 and iou[3, 3] == 1
    assert iou[0, 1] == 0 and iou[1, 0] == 0 and (iou[2] == 0).all() and (iou[:, 2] == 0).all()
    assert iou[0, 3] == pytest.approx(0.125 * 0.25 / 0.25)
    assert (iou[4:] == 0).all() and (iou[:, 4:] == 0).all()

