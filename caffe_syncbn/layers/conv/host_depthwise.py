"""Depthwise convolution and deconvolution on the host: group == channels == outputs, 2-D.

Each output plane of a depthwise convolution is its input plane correlated with one small
kernel, so the work is KH x KW shifted multiply-adds over the planes (a gather), where the
GEMM path makes an im2col copy and one tiny GEMM per channel. Its data gradient adds the
same shifted planes back (a scatter). A Deconvolution is the adjoint: its forward is the
scatter and its data gradient the gather. Both slide the kernel over a "wide" plane (a
Convolution's input, a Deconvolution's output), padded, and put its positions on a
"narrow" one (the other side); the weight gradient pairs the two in either case.

Every pass over a tap is a numpy call over contiguous arrays: the padded wide planes are
laid out by the stride's phases, and the narrow planes padded to a phase's shape
(``_Layout``), so that a tap's windows are one contiguous run (numpy adds into a strided
view about three times as slowly). The passes walk blocks of (image, channel) planes a
few hundred KB at a time, split over cpu_threads; each pass lays out a block's inputs
before it writes the block's outputs, so a layer may run in place. The blocks follow from
the shape alone, the weight gradient is summed per block and the blocks' sums added in
block order, so the result does not depend on the threads.
"""
import numpy as np

from ...backend import cpu_threads


def applies(layer):
    """Whether this module runs ``layer`` (a Convolution or Deconvolution set up with its
    geometry), whatever its engine says: MobileNet-style prototxts set ``engine: CAFFE``
    on their depthwise layers to keep them off cuDNN, not to ask for im2col."""
    return (layer.num_spatial == 2 and layer.group > 1
            and layer.group == layer.channels == layer.num_output)


class _Layout:
    """A padded wide plane split by the stride (sh, sw) into sh * sw phases, the planes of
    its positions (a + sh * u, b + sw * v), each ``rows`` x ``cols``. A tap (i, j) at
    narrow position (y, x) reads wide position (i * dh + sh * y, j * dw + sw * x), which
    is phase ((i * dh) % sh, (j * dw) % sw) at (y + (i * dh) // sh, x + (j * dw) // sw).
    A block's planes of one phase lie one after the other in one flat row, and its narrow
    planes are padded to ``rows`` x ``cols`` with zeros, so that a tap's windows over the
    whole block are the run of ``planes * rows * cols`` values from the tap's offset, and
    each pass over them one numpy call over contiguous arrays. What a window reads past a
    narrow plane's rows (the next row or plane) meets those zeros or is thrown away."""

    def __init__(self, layer):
        if layer.transposed:
            (h, w), self.narrow = layer.out_spatial, tuple(layer.in_spatial)
        else:
            (h, w), self.narrow = layer.in_spatial, tuple(layer.out_spatial)
        (kh, kw), (sh, sw), (dh, dw) = layer.kernel, layer.stride, layer.dilation
        (ph, pw) = layer.pad
        self.rows, self.cols = -(-(h + 2 * ph) // sh), -(-(w + 2 * pw) // sw)
        self.plane, self.phase_count = self.rows * self.cols, sh * sw
        self.taps = [((i * dh) % sh * sw + (j * dw) % sw, (i * dh) // sh * self.cols
                      + (j * dw) // sw) for i in range(kh) for j in range(kw)]
        self.tail = max(offset for _, offset in self.taps)      # the last window's overrun
        # each phase's part of the unpadded wide plane: (phase, its rows and columns there,
        # the wide plane's rows and columns)
        self.parts = []
        for a in range(sh):
            u, r = _first_inside(a, ph, sh)
            for b in range(sw):
                v, c = _first_inside(b, pw, sw)
                rows, cols = range(r, h, sh), range(c, w, sw)
                self.parts.append((a * sw + b, slice(u, u + len(rows)), slice(v, v + len(cols)),
                                   slice(r, h, sh), slice(c, w, sw)))

    def empty_phases(self, count, dtype, use):
        """Room for the phases of ``count`` planes: (phases, count * plane + tail)."""
        return cpu_threads.scratch_array(use, (self.phase_count, count * self.plane + self.tail),
                                         dtype)

    def grids(self, phases, count):
        """Each phase of ``count`` planes as (phases, count, rows, cols)."""
        return phases[:, :count * self.plane].reshape(-1, count, self.rows, self.cols)

    def window(self, phases, tap, count):
        """A tap's windows over ``count`` planes, (count, plane)."""
        phase, offset = tap
        return phases[phase, offset:offset + count * self.plane].reshape(count, self.plane)

    def phases(self, wide):
        """Planes ``wide`` (planes, H, W) padded and laid out by phase."""
        phases = self.empty_phases(len(wide), wide.dtype, 'depthwise phases')
        phases[...] = 0
        grids = self.grids(phases, len(wide))
        for phase, us, vs, rs, cs in self.parts:
            grids[phase, :, us, vs] = wide[:, rs, cs]
        return phases

    def unpad(self, phases, wide):
        """``wide`` (planes, H, W) = the padded planes ``phases`` without the padding."""
        grids = self.grids(phases, len(wide))
        for phase, us, vs, rs, cs in self.parts:
            wide[:, rs, cs] = grids[phase, :, us, vs]

    def spaced(self, narrow):
        """Planes ``narrow`` (planes, OH, OW) padded with zeros to (planes, plane)."""
        (oh, ow), count = self.narrow, len(narrow)
        out = cpu_threads.scratch_array('depthwise spaced', (count, self.rows, self.cols),
                                        narrow.dtype)
        out[:, oh:] = 0
        out[:, :oh, ow:] = 0
        out[:, :oh, :ow] = narrow
        return out.reshape(count, self.plane)


def _first_inside(phase, pad, stride):
    """(u, r): the first row u of ``phase`` that is inside the unpadded plane, at its row r."""
    u = max(0, -((phase - pad) // stride))
    return u, phase + stride * u - pad


def _gather(layout, phases, weight, channels, target, bias=None):
    """``target`` (narrow planes) = ``bias`` + each tap's window of ``phases`` times the
    tap's weight."""
    count, (oh, ow) = len(target), layout.narrow
    sums = cpu_threads.scratch_array('depthwise gathered', (count, layout.plane), target.dtype)
    sums[...] = 0 if bias is None else bias[channels, None]
    product = cpu_threads.scratch_array('depthwise product', sums.shape, target.dtype)
    for k, tap in enumerate(layout.taps):
        np.multiply(layout.window(phases, tap, count), weight[channels, k, None], out=product)
        sums += product
    target[...] = sums.reshape(count, layout.rows, layout.cols)[:, :oh, :ow]


def _scatter(layout, spaced, weight, channels, target, bias=None):
    """``target`` (wide planes) = ``bias`` + ``spaced`` (narrow planes, ``layout.spaced``)
    times each tap's weight, added at the tap's window, the padding cut off."""
    count = len(target)
    phases = layout.empty_phases(count, target.dtype, 'depthwise scattered')
    phases[...] = 0
    if bias is not None:
        layout.grids(phases, count)[...] = bias[channels, None, None]
    product = cpu_threads.scratch_array('depthwise product', spaced.shape, target.dtype)
    for k, tap in enumerate(layout.taps):
        np.multiply(spaced, weight[channels, k, None], out=product)
        window = layout.window(phases, tap, count)
        window += product
    layout.unpad(phases, target)


def _tap_sums(layout, phases, spaced, channels, count):
    """(taps, channels): for each tap and channel, the sum over that channel's planes of
    ``spaced`` times the tap's window of ``phases``."""
    sums = np.empty((len(layout.taps), count), phases.dtype)
    for k, tap in enumerate(layout.taps):
        per_plane = np.matmul(spaced[:, None, :],
                              layout.window(phases, tap, len(spaced))[:, :, None])
        sums[k] = np.bincount(channels, per_plane.reshape(-1), minlength=count)
    return sums


def _run(layer, layout, planes, dtype, work):
    """``work(r0, r1, channels)`` over blocks of ``planes`` (image, channel) planes, with
    the channel of each plane; a block holds about BLOCK_BYTES of laid-out wide planes."""
    size = layout.phase_count * layout.plane
    per_block = max(1, cpu_threads.BLOCK_BYTES // (size * np.dtype(dtype).itemsize))

    def part(first, stop):
        for b in range(first, stop):
            r0, r1 = b * per_block, min(planes, (b + 1) * per_block)
            work(r0, r1, np.arange(r0, r1) % layer.channels)
    cpu_threads.split(-(-planes // per_block), part,
                      max(1, cpu_threads.PARALLEL_MIN_ELEMENTS // (per_block * size)))


def _planes(array, spatial):
    return array.reshape((-1,) + tuple(spatial))


def forward(layer, x4, y3):
    """``y3`` (N, C, OH*OW) = the depthwise (de)convolution of ``x4`` (N, C, H, W), bias
    added."""
    layout = _Layout(layer)
    x, y = _planes(x4, layer.in_spatial), _planes(y3, layer.out_spatial)
    weight = layer.blobs[0].data.reshape(layer.channels, -1)
    bias = layer.blobs[1].data if layer.bias_term else None

    def work(r0, r1, channels):
        if layer.transposed:
            _scatter(layout, layout.spaced(x[r0:r1]), weight, channels, y[r0:r1], bias)
        else:
            _gather(layout, layout.phases(x[r0:r1]), weight, channels, y[r0:r1], bias)
    _run(layer, layout, len(x), x.dtype, work)


def backward(layer, x4, dy3, dx4, weight_grad):
    """Accumulate the weight gradient into ``weight_grad`` (C * KH * KW values as (C, 1,
    KH*KW) or (C, 1, KH, KW), or None) and write ``dx4`` (N, C, H, W, or None) from
    ``dy3`` (N, C, OH*OW)."""
    layout = _Layout(layer)
    x, dy = _planes(x4, layer.in_spatial), _planes(dy3, layer.out_spatial)
    dx = None if dx4 is None else _planes(dx4, layer.in_spatial)
    weight = layer.blobs[0].data.reshape(layer.channels, -1)
    partial = {}

    def work(r0, r1, channels):
        if layer.transposed:            # dy is the wide side, laid out once for both
            phases = layout.phases(dy[r0:r1])
            if dx is not None:
                _gather(layout, phases, weight, channels, dx[r0:r1])
            spaced = layout.spaced(x[r0:r1]) if weight_grad is not None else None
        else:
            spaced = layout.spaced(dy[r0:r1])
            if dx is not None:
                _scatter(layout, spaced, weight, channels, dx[r0:r1])
            phases = layout.phases(x[r0:r1]) if weight_grad is not None else None
        if weight_grad is not None:
            partial[r0] = _tap_sums(layout, phases, spaced, channels, layer.channels)
    _run(layer, layout, len(x), x.dtype, work)
    if weight_grad is not None and partial:
        total = sum(partial[r0] for r0 in sorted(partial))
        weight_grad += total.T.reshape(weight_grad.shape).astype(weight_grad.dtype)
