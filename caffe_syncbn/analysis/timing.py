"""Per-layer forward/backward timings, as `caffe time` prints them, the nets they run, and
a process's peak memory."""
import time

import numpy as np

from ..caffe_pb2 import TEST, TRAIN
from ..convert.inputs import with_inputs
from ..memory_planner import DEFAULT_PLAN
from ..net import Net
from ..netparam.graph import layer_included, net_state
from ..netparam.inputs import is_data_layer
from ..netparam.upgrade import load_net_param


def timing_net_param(model, batch=None, force_backward=True, phase=TRAIN, level=0, stages=(),
                     input_shape=None):
    """The NetParameter that `caffe time` should run to time ``model`` (a path or a
    NetParameter) in ``phase`` as we do: the phase's data layers become Input layers of
    the shapes their sources give (``input_shape``, N,C,H,W, sizes the first top of every
    data and Input layer instead), the other phases' data layers are left out, every
    Input's first axis is ``batch`` (when given) and backward is forced (unless
    ``force_backward`` is False), so both programs do the same work."""
    param = load_net_param(model)
    state = net_state(param, phase, level, stages)
    timed = [layer for layer in param.layer
             if not is_data_layer(layer) or layer_included(layer, state)]
    del param.layer[:]
    param.layer.extend(timed)
    param = with_inputs(param, input_shape, batch)
    if batch:
        for layer in param.layer:
            if layer.type == 'Input':
                for shape in layer.input_param.shape:
                    if len(shape.dim):
                        shape.dim[0] = batch
    param.force_backward = force_backward
    return param


def build_timing_net(model, batch=None, phase='TRAIN', level=0, stages=(),
                     memory_plan=DEFAULT_PLAN['pycaffe'], input_shape=None):
    """A Net for timing (timing_net_param: Input layers of batch ``batch``, shaped by their
    sources or ``input_shape``, backward forced), as the benchmarks time it."""
    phase = TRAIN if phase == 'TRAIN' else TEST
    return Net(timing_net_param(model, batch, phase=phase, level=level, stages=stages,
                                input_shape=input_shape),
               phase, level=level, stages=stages, memory_plan=memory_plan)


def peak_memory_kb():
    """This process's peak resident memory (VmHWM) in KiB: unlike ru_maxrss, it counts
    nothing of a parent's memory that the process was forked or spawned from."""
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith('VmHWM:'):
                return int(line.split()[1])
    raise OSError('no VmHWM in /proc/self/status')


def _synchronize(net):
    xp = net.context.xp
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def time_net(net, iterations=10, warmup=1, backward=True):
    """Run forward (+backward) ``iterations`` times; return mean seconds per layer and in total.

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
        for i in reversed(range(n if backward else 0)):
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
