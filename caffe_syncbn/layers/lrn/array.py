"""LRN's array engine, across channels or within each channel, which runs on numpy and CuPy
alike: centred, zero-padded window sums, which being symmetric serve the backward too. The
host (host.py) and CUDA (gpu.py) engines have its signatures, across channels only."""


def centered_window_sum(a, axis, size):
    """Sum over the ``size`` cells centred on each cell along ``axis`` (zeros outside)."""
    total = a.copy()
    lead = (slice(None),) * axis
    for d in range(1, (size - 1) // 2 + 1):
        total[lead + (slice(d, None),)] += a[lead + (slice(None, -d),)]
        total[lead + (slice(None, -d),)] += a[lead + (slice(d, None),)]
    return total


def _window_sum(layer, a):
    if layer.across:
        return centered_window_sum(a, 1, layer.size)
    return centered_window_sum(centered_window_sum(a, 2, layer.size), 3, layer.size)


def forward(layer, bottom, top):
    x = bottom[0].data
    layer.scale = layer.k + (layer.alpha / layer.cells) * _window_sum(layer, x * x)
    top[0].data[...] = x * layer.scale ** -layer.beta


def backward(layer, top, propagate_down, bottom):
    if not propagate_down[0]:
        return
    x, y, dy, scale = bottom[0].data, top[0].data, top[0].diff, layer.scale
    through_scale = _window_sum(layer, dy * y / scale)
    bottom[0].diff[...] = (dy * scale ** -layer.beta
                           - (2 * layer.alpha * layer.beta / layer.cells) * x * through_scale)
