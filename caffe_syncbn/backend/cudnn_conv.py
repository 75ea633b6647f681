"""Convolutions through cuDNN, by NVIDIA's cuDNN Frontend Python API (``import cudnn``, the
``nvidia-cudnn-frontend`` wheel, over the ``nvidia-cudnn-cu13`` library).

**Off unless ``CAFFE_SYNCBN_CUDNN=1``**: it has not yet run on a GPU (docs/gpu.md, "The cuDNN
engine"). Where it is off, or the frontend does not import, convolutions run im2col + GEMM.

Three graphs serve a convolution: ``fprop`` (y from x and w), ``dgrad`` (dx from dy and w)
and ``wgrad`` (dw from x and dy), NCHW (or NCDHW), C-contiguous, groups given by the
channels of x against those of w. Each is built once per geometry (``Geometry``: the pass,
the shapes of x, w and y, and so the groups, pad, stride, dilation, dtype and whether TF32
may run), per
thread and device: cuDNN wants a handle per thread, and a plan finalized with one handle
runs with that handle. Each runs on the calling thread's current stream of the arrays'
device, the stream a replica's worker thread owns, so its work is ordered with the layers
around it as a kernel launch is. Float32 convolutions keep float32's precision: engines
that round inputs (TF32 tensor cores, down-converted inputs) are left out unless
``CUPY_TF32=1`` allows TF32, the switch of CuPy's float32 GEMMs; float16 ones accumulate
in float32.
"""
import collections
import functools
import logging
import os
import threading
import weakref

import numpy as np

from .device import runtime_of

log = logging.getLogger('caffe_syncbn')

SWITCH = 'CAFFE_SYNCBN_CUDNN'
#: the array dtypes the engine takes, by cuDNN's data type name; float64 and bfloat16
#: (no CuPy dtype) stay with im2col
DATA_TYPES = {np.dtype(np.float32): 'FLOAT', np.dtype(np.float16): 'HALF'}
PASSES = ('fprop', 'dgrad', 'wgrad')


class Geometry(collections.namedtuple(
        'Geometry', 'step x w y pad stride dilation dtype tf32')):
    """What a graph is built for: ``step`` one of PASSES; ``x``, ``w``, ``y`` the shapes of
    the convolution's input (N, C, *spatial), filter (K, C / groups, *kernel) and output
    (N, K, *out); ``dtype`` a numpy dtype name; ``tf32`` whether float32 may round to TF32."""

    __slots__ = ()

    @property
    def groups(self):
        return self.x[1] // self.w[1]


def enabled():
    """Whether ``CAFFE_SYNCBN_CUDNN=1`` asks for the engine."""
    return os.environ.get(SWITCH, '') == '1'


def tf32_allowed():
    """TF32 for float32 convolutions: ``CUPY_TF32=1``, as for CuPy's float32 GEMMs."""
    return os.environ.get('CUPY_TF32', '') == '1'


@functools.lru_cache(maxsize=None)
def frontend():
    """The ``cudnn`` module, or None when it does not import (said once, in the log)."""
    try:
        import cudnn
    except Exception as exc:        # ImportError, or a library it cannot load
        log.warning('%s=1, but the cuDNN frontend does not import (%s: %s): convolutions '
                    'run im2col + GEMM', SWITCH, type(exc).__name__, exc)
        return None
    return cudnn


def applies(dtype, weight_dtype, num_spatial):
    """Whether the engine may run a convolution of ``dtype`` inputs and outputs and
    ``weight_dtype`` weights over ``num_spatial`` axes: asked for, importable, 2-D or 3-D,
    and one dtype it takes for both (mixed precision keeps float32 weights: im2col)."""
    dtype, weight_dtype = np.dtype(dtype), np.dtype(weight_dtype)
    return (enabled() and num_spatial in (2, 3) and dtype in DATA_TYPES
            and weight_dtype == dtype and frontend() is not None)


def define(cudnn, geometry, handle=None):
    """The graph of ``geometry`` on ``handle``, not yet built, and its tensors by role:
    {'x', 'w', 'y'} in the convolution's terms, whichever the pass reads or writes."""
    data_type = getattr(cudnn.data_type, DATA_TYPES[np.dtype(geometry.dtype)])
    compute = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=data_type, intermediate_data_type=compute,
                          compute_data_type=compute, handle=handle)
    attrs = dict(padding=list(geometry.pad), stride=list(geometry.stride),
                 dilation=list(geometry.dilation), compute_data_type=compute)

    def tensor(role):
        shape = getattr(geometry, role)
        return graph.tensor(name=role, dim=list(shape), stride=contiguous_strides(shape),
                            data_type=data_type)

    def output(role, made):
        shape = getattr(geometry, role)
        made.set_output(True).set_dim(list(shape)).set_stride(
            contiguous_strides(shape)).set_data_type(data_type)
        return made

    if geometry.step == 'fprop':
        x, w = tensor('x'), tensor('w')
        y = output('y', graph.conv_fprop(image=x, weight=w, name='fprop', **attrs))
    elif geometry.step == 'dgrad':
        y, w = tensor('y'), tensor('w')
        x = output('x', graph.conv_dgrad(loss=y, filter=w, name='dgrad', **attrs))
    else:
        x, y = tensor('x'), tensor('y')
        w = output('w', graph.conv_wgrad(image=x, loss=y, name='wgrad', **attrs))
    notes = cudnn.numerical_note
    left_out = [notes.REDUCED_PRECISION_REDUCTION, notes.DOWN_CONVERT_INPUTS]
    if np.dtype(geometry.dtype) == np.float32 and not geometry.tf32:
        left_out.append(notes.TENSOR_CORE)      # float32 on tensor cores is TF32
    graph.deselect_numeric_notes(left_out)
    return graph, {'x': x, 'w': w, 'y': y}


def contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return strides[::-1]


class NoPlan(Exception):
    """cuDNN builds no plan for a geometry: its convolution runs im2col instead."""


_unplanned = set()
_unplanned_lock = threading.Lock()


def unplanned():
    """The geometries for which cuDNN built no plan in this process (they ran im2col)."""
    with _unplanned_lock:
        return set(_unplanned)


class Session:
    """One thread's cuDNN on one device: its handle and the graphs built with it. The
    handle is destroyed with the Session, when its thread ends (a solver's replicas), but
    not at the interpreter's exit, when CUDA may be gone before it."""

    def __init__(self, cudnn, device):
        self.cudnn, self.device = cudnn, device
        self.handle = cudnn.create_handle()
        #: Geometry -> (graph, tensors, workspace bytes), or None where no plan builds
        self.graphs = {}
        weakref.finalize(self, release, cudnn, self.handle, self.graphs).atexit = False

    def graph(self, geometry):
        if geometry not in self.graphs:
            graph, tensors = define(self.cudnn, geometry, self.handle)
            try:
                graph.build([self.cudnn.heur_mode.A, self.cudnn.heur_mode.FALLBACK])
                self.graphs[geometry] = (graph, tensors, int(graph.get_workspace_size()))
            except Exception as exc:    # the frontend's errors have no common base
                self.graphs[geometry] = None
                with _unplanned_lock:       # once, not once per replica
                    first = geometry not in _unplanned
                    _unplanned.add(geometry)
                if first:
                    log.warning('cuDNN builds no %s plan for %s (%s: %s): it runs im2col + '
                                'GEMM', geometry.step, describe(geometry), type(exc).__name__,
                                exc)
        if self.graphs[geometry] is None:
            raise NoPlan(describe(geometry))
        return self.graphs[geometry]

    def run(self, geometry, arrays):
        """Enqueue ``geometry``'s pass on the current stream of the arrays' device:
        ``arrays`` {'x', 'w', 'y'} holds the two it reads and the one it writes. NoPlan
        where cuDNN has none, before anything is enqueued."""
        graph, tensors, workspace_bytes = self.graph(geometry)
        streams = runtime_of(arrays['x']).streams(self.device)
        stream = streams.current_stream()
        self.cudnn.set_stream(self.handle, streams.handle(stream))
        workspace = streams.empty(max(workspace_bytes, 1), np.uint8, stream)
        graph.execute({tensors[role]: streams.pointer(array) for role, array in arrays.items()},
                      streams.pointer(workspace), handle=self.handle)


def release(cudnn, handle, graphs):
    """The plans made with ``handle`` go first, then the handle."""
    graphs.clear()
    cudnn.destroy_handle(handle)


def describe(geometry):
    return ('%s x %s -> %s, pad %s, stride %s, dilation %s, groups %d'
            % (geometry.x, geometry.w, geometry.y, geometry.pad, geometry.stride,
               geometry.dilation, geometry.groups)) + ', %s%s' % (
                   geometry.dtype, ' (TF32)' if geometry.tf32 else '')


_sessions = threading.local()


def session(device):
    """The calling thread's Session on ``device`` (an index) with the frontend that
    imported, made at its first use: a handle belongs to one thread, device and library."""
    sessions = getattr(_sessions, 'made', None)
    if sessions is None:
        sessions = _sessions.made = {}
    cudnn = frontend()
    found = sessions.get((device, cudnn))
    if found is None:
        found = sessions[device, cudnn] = Session(cudnn, device)
    return found


def run(step, x, w, y, pad, stride, dilation):
    """Enqueue one pass of a convolution whose input is ``x`` (N, C, *spatial), filter ``w``
    (K, C / groups, *kernel) and output ``y`` (N, K, *out), all contiguous arrays of one
    device and dtype: 'fprop' writes y, 'dgrad' writes x, 'wgrad' writes w. NoPlan where
    cuDNN builds none for this geometry (said once in the log)."""
    geometry = Geometry(step, tuple(x.shape), tuple(w.shape), tuple(y.shape), tuple(pad),
                        tuple(stride), tuple(dilation), np.dtype(x.dtype).name,
                        tf32_allowed() and np.dtype(x.dtype) == np.float32)
    session(x.device.id).run(geometry, {'x': x, 'w': w, 'y': y})
