"""A stand-in for NVIDIA's cuDNN frontend (``import cudnn``) on the GPU emulation, so that the
cuDNN convolution engine (caffe_syncbn/backend/cudnn_conv.py, layers/conv/gpu_cudnn.py)
runs without a GPU: ``installed(monkeypatch, runtime)`` puts it under ``sys.modules['cudnn']``.

It keeps the part of the frontend's graph API that the engine uses, with its names
(``pygraph``, ``tensor``, ``conv_fprop(image, weight)``, ``conv_dgrad(loss, filter)``,
``conv_wgrad(image, loss)``, ``set_output``/``set_dim``/``set_stride``/``set_data_type``,
``deselect_numeric_notes``, ``build``, ``get_workspace_size``, ``execute``,
``create_handle``, ``set_stream``), and holds the engine to what cuDNN holds it to: a
graph is built before it runs, and runs with the handle it was built with, from the thread
that made the handle, with every tensor of the graph bound to a pointer. Its passes are
float64 loops over the kernel offsets, written here and sharing nothing with the engines
they check; they read and write the emulated device arrays through the pointers the
engine hands over, in each tensor's dims, strides and data type.

What it records, for the tests: ``builds`` (each graph built: its pass, dims and the notes
it left out), ``handles`` (thread and device of each), ``streams`` (what each execute ran
on), ``executes``; and ``refused``, the passes it builds no plan for.
"""
import contextlib
import ctypes
import itertools
import sys
import threading
import types

import numpy as np

from caffe_syncbn.backend import cudnn_conv

DTYPES = {'FLOAT': np.float32, 'HALF': np.float16}
WORKSPACE = 64


class _Enum:
    def __init__(self, *names):
        for name in names:
            setattr(self, name, name)


class Handle:
    def __init__(self, device):
        self.device, self.thread, self.stream = device, threading.get_ident(), None
        self.destroyed = False


class Tensor:
    def __init__(self, graph, name, dim=None, stride=None, data_type=None):
        self.graph, self.name = graph, name
        self.dim, self.stride, self.data_type, self.output = dim, stride, data_type, False

    def set_output(self, value):
        self.output = value
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, data_type):
        self.data_type = data_type
        return self


class FakeCudnn(types.ModuleType):
    """The module: its enums, handles and graphs, and what the tests read back."""

    def __init__(self, runtime):
        super().__init__('cudnn')
        self.runtime = runtime
        self.__version__ = '1.32.0 (fake)'
        self.data_type = _Enum('FLOAT', 'HALF', 'DOUBLE', 'BFLOAT16')
        self.numerical_note = _Enum('TENSOR_CORE', 'DOWN_CONVERT_INPUTS',
                                    'REDUCED_PRECISION_REDUCTION', 'FFT', 'WINOGRAD')
        self.heur_mode = _Enum('A', 'B', 'FALLBACK')
        self.builds, self.handles, self.streams, self.executes = [], [], [], 0
        #: the passes for which build() finds no plan, as cuDNN may for a geometry
        self.refused = set()
        self.lock = threading.Lock()
        module = self

        class pygraph(Graph):           # the frontend's own spelling
            fake = module
        self.pygraph = pygraph

    def create_handle(self):
        handle = Handle(self.runtime.current_index())
        with self.lock:
            self.handles.append(handle)
        return handle

    def set_stream(self, handle, stream):
        assert not handle.destroyed
        handle.stream = stream

    def destroy_handle(self, handle):
        assert not handle.destroyed, 'a handle destroyed twice'
        handle.destroyed = True


class Graph:
    fake = None

    def __init__(self, io_data_type=None, intermediate_data_type=None, compute_data_type=None,
                 handle=None, **kwargs):
        assert compute_data_type == 'FLOAT', 'the engine computes in float32'
        self.io_data_type, self.handle = io_data_type, handle
        self.tensors, self.step, self.attrs, self.left_out = [], None, None, []
        self.built = False

    def tensor(self, name, dim, stride, data_type):
        made = Tensor(self, name, list(dim), list(stride), data_type)
        self.tensors.append(made)
        return made

    def _op(self, step, inputs, attrs):
        assert self.step is None, 'one convolution per graph'
        assert all(t.graph is self for t in inputs.values())
        self.step, self.inputs, self.attrs = step, inputs, attrs
        self.out = Tensor(self, step)
        self.tensors.append(self.out)
        return self.out

    def conv_fprop(self, image, weight, padding, stride, dilation, compute_data_type, name=''):
        return self._op('fprop', {'x': image, 'w': weight}, (padding, stride, dilation))

    def conv_dgrad(self, loss, filter, padding, stride, dilation, compute_data_type, name=''):
        return self._op('dgrad', {'y': loss, 'w': filter}, (padding, stride, dilation))

    def conv_wgrad(self, image, loss, padding, stride, dilation, compute_data_type, name=''):
        return self._op('wgrad', {'x': image, 'y': loss}, (padding, stride, dilation))

    def deselect_numeric_notes(self, notes):
        self.left_out.extend(notes)
        return self

    def build(self, heuristics):
        assert self.out.output and self.out.dim and self.out.data_type, 'an unset output'
        if self.step in self.fake.refused:
            raise RuntimeError('no engine config for this %s graph' % self.step)
        self.built = True
        with self.fake.lock:
            self.fake.builds.append({'step': self.step, 'dims': [t.dim for t in self.tensors],
                                     'data_type': self.io_data_type,
                                     'left_out': sorted(self.left_out),
                                     'thread': threading.get_ident()})

    def get_workspace_size(self):
        assert self.built
        return WORKSPACE

    def execute(self, pack, workspace, handle=None):
        assert self.built, 'execute before build'
        assert handle is self.handle, 'a plan runs with the handle it was built with'
        assert handle.thread == threading.get_ident(), 'a handle is used by its own thread'
        assert set(pack) == set(self.tensors), 'every tensor bound, and nothing else'
        assert isinstance(workspace, int) and workspace, 'a workspace pointer'
        arrays = {t: _view(pointer, t) for t, pointer in pack.items()}
        written = next(role for role in 'xwy' if role not in self.inputs)
        pad, stride, dilation = self.attrs
        given = {role: arrays[t].astype(np.float64) for role, t in self.inputs.items()}
        if written == 'y':
            result = fprop(given['x'], given['w'], pad, stride, dilation)
        elif written == 'x':
            result = dgrad(given['y'], given['w'], self.out.dim, pad, stride, dilation)
        else:
            result = wgrad(given['x'], given['y'], self.out.dim, pad, stride, dilation)
        arrays[self.out][...] = result
        with self.fake.lock:
            self.fake.streams.append(handle.stream)
            self.fake.executes += 1


def _view(pointer, tensor):
    dtype = np.dtype(DTYPES[tensor.data_type])
    extent = 1 + sum((d - 1) * s for d, s in zip(tensor.dim, tensor.stride))
    raw = (ctypes.c_char * (extent * dtype.itemsize)).from_address(pointer)
    flat = np.frombuffer(raw, dtype)
    return np.lib.stride_tricks.as_strided(flat, tensor.dim,
                                           [s * dtype.itemsize for s in tensor.stride])


# ---- the three passes, in float64 -------------------------------------------------------------
def _windows(spatial_out, offset, stride, dilation):
    """The slices of a padded input that kernel offset ``offset`` reads for every output."""
    return tuple(slice(o * d, o * d + s * (n - 1) + 1, s)
                 for o, d, s, n in zip(offset, dilation, stride, spatial_out))


def _group_slices(x_channels, w_shape):
    """Per group, its slice of the filters (outputs) and of the input channels."""
    groups = x_channels // w_shape[1]
    per_k, per_c = w_shape[0] // groups, w_shape[1]
    return [(slice(g * per_k, (g + 1) * per_k), slice(g * per_c, (g + 1) * per_c))
            for g in range(groups)]


def fprop(x, w, pad, stride, dilation):
    spatial = len(pad)
    padded = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in pad])
    out = [(padded.shape[2 + i] - dilation[i] * (w.shape[2 + i] - 1) - 1) // stride[i] + 1
           for i in range(spatial)]
    y = np.zeros([x.shape[0], w.shape[0]] + out)
    for offset in itertools.product(*[range(k) for k in w.shape[2:]]):
        taken = padded[(slice(None), slice(None)) + _windows(out, offset, stride, dilation)]
        for ks, cs in _group_slices(x.shape[1], w.shape):
            y[:, ks] += np.einsum('kc,nc...->nk...', w[(ks, slice(None)) + offset], taken[:, cs])
    return y


def dgrad(dy, w, x_dim, pad, stride, dilation):
    out = list(dy.shape[2:])
    padded = np.zeros(list(x_dim[:2]) + [s + 2 * p for s, p in zip(x_dim[2:], pad)])
    for offset in itertools.product(*[range(k) for k in w.shape[2:]]):
        window = (slice(None), slice(None)) + _windows(out, offset, stride, dilation)
        for ks, cs in _group_slices(x_dim[1], w.shape):
            padded[window][:, cs] += np.einsum('kc,nk...->nc...', w[(ks, slice(None)) + offset],
                                               dy[:, ks])
    return padded[(slice(None), slice(None)) + tuple(slice(p, p + s) for p, s in
                                                     zip(pad, x_dim[2:]))]


def wgrad(x, dy, w_dim, pad, stride, dilation):
    out = list(dy.shape[2:])
    padded = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in pad])
    dw = np.zeros(w_dim)
    for offset in itertools.product(*[range(k) for k in w_dim[2:]]):
        taken = padded[(slice(None), slice(None)) + _windows(out, offset, stride, dilation)]
        for ks, cs in _group_slices(x.shape[1], w_dim):
            flat_dy, flat_x = dy[:, ks], taken[:, cs]
            dw[(ks, slice(None)) + offset] = np.einsum(
                'nkp,ncp->kc', flat_dy.reshape(flat_dy.shape[:2] + (-1,)),
                flat_x.reshape(flat_x.shape[:2] + (-1,)))
    return dw


@contextlib.contextmanager
def installed(monkeypatch, runtime):
    """The fake as ``cudnn``, with the engine switched on, for the rest of the test (through
    the test's own ``monkeypatch``, so that every patch of the test is undone in order); the
    frontend that the engine found is forgotten when the block ends. Yields the fake."""
    fake = FakeCudnn(runtime)
    monkeypatch.setitem(sys.modules, 'cudnn', fake)
    monkeypatch.setenv(cudnn_conv.SWITCH, '1')
    cudnn_conv.frontend.cache_clear()
    try:
        yield fake
    finally:
        cudnn_conv.frontend.cache_clear()
