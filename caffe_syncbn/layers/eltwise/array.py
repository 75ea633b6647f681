"""Eltwise SUM's array engine, which runs on numpy and CuPy alike, block by block, with the
ReLU a SUM absorbed (Layer.absorb) in the same pass; the CUDA engine (gpu.py) has its
signatures. ``top`` is the output the sum writes: the layer's top, or the absorbed ReLU's."""
from ...backend.cpu_threads import blocks
from ..neuron.layers import relu, relu_gradient


def sum_forward(layer, bottom, top):
    """top = sum of coeff * bottom, block by block into the top; a bottom that is the
    top (in place) goes first, before the top is written."""
    xp = layer.xp
    terms = sorted(zip(layer.coeff, bottom), key=lambda term: term[1] is not top[0])
    out = top[0].data.reshape(-1)
    flat = [(c, b.data.reshape(-1)) for c, b in terms]

    def work(a, b):
        block = out[a:b]
        (c0, x0), (c1, x1) = flat[0], flat[1]
        if c0 == 1 and c1 == 1:
            xp.add(x0[a:b], x1[a:b], out=block)
        else:
            xp.multiply(x0[a:b], c0, out=block)
            block += x1[a:b] * c1 if c1 != 1 else x1[a:b]
        for c, x in flat[2:]:
            block += x[a:b] * c if c != 1 else x[a:b]
        if layer.relu_slope is not None:
            relu(xp, block, layer.relu_slope, block)
    blocks(xp, out.size, 1, work)


def gradient_targets(layer, top, propagate_down, bottom):
    """(coeff, flat diff, whether it is the top's own diff) of each bottom that takes a
    gradient, the one in place last: it must be written after the others read dy."""
    return sorted(((c, b.diff.reshape(-1), b.diff is top[0].diff)
                   for c, b, down in zip(layer.coeff, bottom, propagate_down) if down),
                  key=lambda target: target[2])


def sum_backward(layer, top, propagate_down, bottom):
    """bottom diff = coeff * top diff (through the absorbed ReLU), block by block."""
    xp = layer.xp
    dy, y = top[0].diff.reshape(-1), top[0].data.reshape(-1)
    targets = gradient_targets(layer, top, propagate_down, bottom)

    def work(a, b):
        g = dy[a:b]
        if layer.relu_slope is not None:       # into a new array: dy is the ReLU's top diff
            g = xp.empty_like(g)
            relu_gradient(xp, y[a:b], dy[a:b], layer.relu_slope, g)
        for c, dx, in_place in targets:
            if c != 1:
                xp.multiply(g, c, out=dx[a:b])
            elif not in_place or layer.relu_slope is not None:
                dx[a:b] = g
    blocks(xp, dy.size, 1, work)
