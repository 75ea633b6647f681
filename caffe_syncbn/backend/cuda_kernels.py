"""Loads the CUDA kernels of the ``cuda/`` folder by name, compiled once per process.

``kernel('norm', 'syncbn_normalize_f32')`` returns a ``cupy.RawKernel``-like function that
is called as ``fn(grid, block, args)``. Kernel names carry a dtype suffix (``_f16``, ``_f32``,
``_f64``); ``typed_kernel(stem, base, dtype)`` adds it.

CuPy is imported only here, and only when a kernel is first asked for, so the CPU package
never needs it. ``source(stem)`` (no CuPy) is the exact text NVRTC compiles: the ``.cu`` file
with its local ``#include "x.cuh"`` lines replaced by those files, because CuPy's compile cache
keys on the source text and would not notice a change in an included header.
"""
import functools
import re
import sys
import threading
from pathlib import Path

import numpy as np

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_SUFFIX = {np.dtype(np.float16): 'f16', np.dtype(np.float32): 'f32', np.dtype(np.float64): 'f64'}
COMPILE_OPTIONS = ('-std=c++17',)


def cuda_dir():
    """The folder of the .cu files: the repo's (source tree, editable install), else where
    setup.py's ``data_files`` put them (``<prefix>/share/caffe_syncbn/cuda``)."""
    here = Path(__file__).resolve().parent
    candidates = (here.parent.parent / 'cuda', Path(sys.prefix) / 'share' / 'caffe_syncbn' / 'cuda')
    for candidate in candidates:
        if (candidate / 'common.cuh').is_file():
            return candidate
    raise FileNotFoundError('CUDA kernel sources not found in %s'
                            % ' or '.join(str(c) for c in candidates))


def kernel_stems():
    return sorted(p.stem for p in cuda_dir().glob('*.cu'))


@functools.lru_cache(maxsize=None)
def source(stem):
    """The self-contained source text of ``cuda/<stem>.cu``."""
    folder = cuda_dir()
    seen = set()

    def expand(text):
        def paste(match):
            name = match.group(1)
            if name in seen:  # every header is `#pragma once`: paste it once
                return ''
            seen.add(name)
            return expand((folder / name).read_text())
        return _INCLUDE.sub(paste, text)

    return expand((folder / (stem + '.cu')).read_text())


def dtype_suffix(dtype):
    try:
        return _SUFFIX[np.dtype(dtype)]
    except KeyError:
        raise TypeError('no CUDA kernel for dtype %s (float16, float32 and float64 have one)'
                        % np.dtype(dtype)) from None


_compiled = {}
_compiling = threading.Lock()


def _function(stem, name, device_id):
    """The kernel, compiled once per process and device. The replicas' threads ask at the
    same moment on a cold cache: the lock makes one of them compile while the others wait,
    instead of each compiling the same module."""
    key = (stem, name, device_id)
    function = _compiled.get(key)
    if function is None:
        import cupy
        with _compiling:
            function = _compiled.get(key)
            if function is None:
                with cupy.cuda.Device(device_id):
                    module = _compiled.get((stem, device_id))
                    if module is None:
                        module = _compiled[(stem, device_id)] = cupy.RawModule(
                            code=source(stem), options=COMPILE_OPTIONS)
                    function = _compiled[key] = module.get_function(name)
    return function


def kernel(stem, name):
    """The kernel ``name`` of ``cuda/<stem>.cu`` for the current CUDA device."""
    import cupy
    return _function(stem, name, cupy.cuda.Device().id)


def typed_kernel(stem, base, dtype):
    """``kernel(stem, base + '_' + suffix)`` for the data type ``dtype``."""
    return kernel(stem, '%s_%s' % (base, dtype_suffix(dtype)))


def multiprocessor_count():
    """Streaming multiprocessors of the current device: the kernels size their grids by it."""
    import cupy
    return _multiprocessors(cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_id):
    import cupy
    return cupy.cuda.Device(device_id).attributes['MultiProcessorCount']
