"""Run the kernels of cuda/*.cu on the CPU (no GPU, no CuPy): each .cu source, exactly as
NVRTC would get it (``cuda_kernels.source``), is compiled with g++ against
``cuda_host_emulation.h`` into a shared library; a kernel is then launched as with CuPy,
``fn(grid, block, args)``, on numpy arrays.

Scalars must carry their C type as numpy scalars (np.int32, np.int64, np.float32,
np.float64), as CuPy also wants them; None is a null pointer.

``emulated_kernels(monkeypatch)`` points ``caffe_syncbn.backend.cuda_kernels.kernel`` at these, so
the GPU launchers of caffe_syncbn/layers/*_gpu.py run unchanged over numpy arrays.
"""
import atexit
import ctypes
import functools
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from caffe_syncbn.backend import cuda_kernels

HERE = Path(__file__).resolve().parent
_MARKED_ENTRY = re.compile(r'EMU_KERNEL_ENTRY\s+void\s+(\w+)\s*\(')
_BUILD_DIR = None
#: the emulation keeps the launch geometry in globals: one launch at a time
_LAUNCH_LOCK = threading.Lock()


def kernel_names(stem):
    """Every extern "C" kernel name of cuda/<stem>.cu, macro instantiations included: the
    preprocessor expands the source with ``__global__`` marked."""
    cmd = [_compiler(), '-x', 'c++', '-std=c++20', '-E', '-P', '-DCAFFE_SYNCBN_HOST_EMULATION',
           '-D__global__=EMU_KERNEL_ENTRY', '-D__launch_bounds__(...)=', '-']
    result = subprocess.run(cmd, input=cuda_kernels.source(stem), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError('preprocessing cuda/%s.cu failed:\n%s' % (stem, result.stderr[-4000:]))
    return sorted(set(_MARKED_ENTRY.findall(result.stdout)))


def _compiler():
    compiler = shutil.which('g++')
    if compiler is None:
        pytest.skip('g++ not found: the CPU emulation of the CUDA kernels needs it')
    return compiler


@functools.lru_cache(maxsize=None)
def _library(stem):
    global _BUILD_DIR
    if _BUILD_DIR is None:
        _BUILD_DIR = tempfile.mkdtemp(prefix='cuda_emu_')
        atexit.register(shutil.rmtree, _BUILD_DIR, ignore_errors=True)
    names = kernel_names(stem)
    code = ('#include "%s"\n' % (HERE / 'cuda_host_emulation.h') + cuda_kernels.source(stem)
            + '\n' + '\n'.join('EMULATE(%s)' % n for n in names) + '\n')
    src = Path(_BUILD_DIR) / (stem + '_emu.cpp')
    lib = Path(_BUILD_DIR) / (stem + '_emu.so')
    src.write_text(code)
    cmd = [_compiler(), '-std=c++20', '-O1', '-shared', '-fPIC', '-pthread', '-w',
           str(src), '-o', str(lib)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError('emulation build of cuda/%s.cu failed:\n%s' % (stem, result.stderr[-4000:]))
    return ctypes.CDLL(str(lib)), frozenset(names)


_CTYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def _c_arg(value):
    if value is None:
        return ctypes.c_void_p(None)
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:
            raise ValueError('kernel arrays must be C-contiguous')
        return ctypes.c_void_p(value.ctypes.data)
    if isinstance(value, np.generic) and value.dtype in _CTYPES:
        return _CTYPES[value.dtype](value.item())
    raise TypeError('pass kernel scalars as numpy scalars with a C type, got %r (%s)'
                    % (value, type(value).__name__))


class EmulatedKernel:
    def __init__(self, stem, name):
        lib, names = _library(stem)
        if name not in names:
            raise AttributeError('cuda/%s.cu has no kernel %r (it has %s)' % (stem, name, sorted(names)))
        self._address = ctypes.c_void_p.in_dll(lib, 'emu_' + name).value
        self.name = name

    def __call__(self, grid, block, args):
        grid = tuple(grid) + (1,) * (3 - len(tuple(grid)))
        block = tuple(block) if isinstance(block, tuple) else (block,)
        if block[1:] not in ((), (1,), (1, 1)):
            raise ValueError('the emulation runs 1-D blocks only, got %s' % (block,))
        c_args = [ctypes.c_uint(int(g)) for g in grid] + [ctypes.c_uint(int(block[0]))]
        c_args += [_c_arg(a) for a in args]
        prototype = ctypes.CFUNCTYPE(None, *[type(a) for a in c_args])
        with _LAUNCH_LOCK:
            prototype(self._address)(*c_args)


def emulated_kernels(monkeypatch, multiprocessors=2):
    """Make caffe_syncbn.backend.cuda_kernels hand out emulated kernels over numpy arrays."""
    monkeypatch.setattr(cuda_kernels, 'kernel', lambda stem, name: EmulatedKernel(stem, name))
    monkeypatch.setattr(cuda_kernels, 'multiprocessor_count', lambda: multiprocessors)
