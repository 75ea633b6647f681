"""Per-layer forward/backward timings, as `caffe time` prints them."""
import time

import numpy as np


def _synchronize(net):
    xp = net.context.xp
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def time_net(net, iterations=10, warmup=1):
    """Run forward+backward ``iterations`` times; return mean seconds per layer and in total.

    Returns {'forward': [(layer name, s)], 'backward': [(layer name, s)],
             'forward_total': s, 'backward_total': s, 'total': s,
             'iterations': [s of each timed forward+backward]}.
    """
    n = len(net.layers)
    fwd, bwd = np.zeros(n), np.zeros(n)
    totals = np.zeros(2)
    iteration_times = []
    for it in range(warmup + iterations):
        counted = it >= warmup
        start = time.perf_counter()
        for i in range(n):
            t0 = time.perf_counter()
            net.forward_prefilled(i, i)
            _synchronize(net)
            if counted:
                fwd[i] += time.perf_counter() - t0
        middle = time.perf_counter()
        for i in reversed(range(n)):
            t0 = time.perf_counter()
            net.backward_from(i, i)
            _synchronize(net)
            if counted:
                bwd[i] += time.perf_counter() - t0
        if counted:
            totals += (middle - start, time.perf_counter() - middle)
            iteration_times.append(time.perf_counter() - start)
    names = net._layer_names
    totals /= iterations
    return {'forward': list(zip(names, fwd / iterations)), 'backward': list(zip(names, bwd / iterations)),
            'forward_total': totals[0], 'backward_total': totals[1], 'total': totals.sum(),
            'iterations': iteration_times}


def format_timings(result, types=None):
    """Caffe-time-like lines: one per layer, then the averages."""
    lines = []
    for (name, f), (_, b) in zip(result['forward'], result['backward']):
        kind = (' (%s)' % types[name]) if types else ''
        lines.append('%20s%s\tforward: %9.3f ms.\tbackward: %9.3f ms.' % (name, kind, f * 1e3, b * 1e3))
    lines.append('Average Forward pass: %.3f ms.' % (result['forward_total'] * 1e3))
    lines.append('Average Backward pass: %.3f ms.' % (result['backward_total'] * 1e3))
    lines.append('Average Forward-Backward: %.3f ms.' % (result['total'] * 1e3))
    return lines
