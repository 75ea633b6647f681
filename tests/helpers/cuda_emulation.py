"""Run the kernels of cuda/*.cu on the CPU (no GPU, no CuPy): each .cu source, with its
``#include "x.cuh"`` lines pasted in as NVRTC gets it, is compiled with g++ against
``cuda_host_emulation.h`` into a shared library; a kernel is then launched as with CuPy,
``fn(grid, block, args)``, on numpy arrays. What the emulation checks and what only a GPU
shows: docs/gpu-emulation.md.

Every launch is checked against the kernel's C signature, read from its preprocessed source,
with CuPy 14's marshalling rules (docs/gpu-emulation.md, "What a launch may pass"): an array
goes to a pointer to its dtype and must be C-contiguous, None is a null pointer, a numpy
scalar is passed as its dtype, a Python int as int64, a Python float as float64, a Python bool
as bool, and a scalar must be of the parameter's exact type. What CuPy would pass wrongly is
a KernelError naming the kernel, the argument and both types.

Environment (read when a kernel is first built or launched):
  CAFFE_SYNCBN_EMU_CUDA_DIR   the folder of the .cu files (default: the repo's cuda/);
                              tools/mutate_kernels.py points it at mutated copies
  CAFFE_SYNCBN_EMU_SCHEDULE   forward (default), reverse or random[:SEED]
  CAFFE_SYNCBN_EMU_SANITIZE   address or thread: build with that sanitizer (the Python
                              process must preload its runtime; see the Makefile's kernel-asan)
  CAFFE_SYNCBN_EMU_BUILD_DIR  where built libraries are cached, keyed by their source

``kernel(stem, name)`` gives an emulated kernel directly (tests/test_cuda_strict_*.py);
``emulated_kernels(monkeypatch)`` points ``caffe_syncbn.backend.cuda_kernels.kernel`` at these,
so the GPU launchers of caffe_syncbn/layers/*_gpu.py run unchanged over numpy arrays.
"""
import contextlib
import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from helpers import cuda_signatures
from caffe_syncbn.backend import cuda_kernels

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HEADER = HERE / 'cuda_host_emulation.h'
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_ENTRY = re.compile(r'EMU_KERNEL_ENTRY\s+void\s+(?:EMU_LAUNCH_BOUNDS\(\s*(\d+)[^)]*\)\s*)?'
                    r'(\w+)\s*\(([^)]*)\)')
#: the emulation keeps the launch geometry in globals: one launch at a time, whichever
#: replica thread asks
_LAUNCH_LOCK = threading.Lock()
_POLICIES = {'forward': 0, 'reverse': 1, 'random': 2}
#: CUDA's launch limits (compute capability 7.0 and later)
MAX_BLOCK = (1024, 1024, 64)
MAX_THREADS = 1024
MAX_GRID = (2 ** 31 - 1, 65535, 65535)


class KernelError(RuntimeError):
    """A launch the emulation refused, or a kernel that broke CUDA's rules while it ran."""


def cuda_dir():
    return Path(os.environ.get('CAFFE_SYNCBN_EMU_CUDA_DIR') or ROOT / 'cuda')


def source(stem):
    """cuda/<stem>.cu with its local headers pasted in (each once), with #line marks so that
    errors and source_location name the original file and line."""
    folder = cuda_dir()
    seen = set()

    def expand(name):
        lines = []
        for number, line in enumerate((folder / name).read_text().splitlines(), 1):
            match = _INCLUDE.match(line)
            if match is None:
                lines.append(line)
                continue
            header = match.group(1)
            if header not in seen:
                seen.add(header)
                lines.append(expand(header))
            lines.append('#line %d "cuda/%s"' % (number + 1, name))
        return '#line 1 "cuda/%s"\n' % name + '\n'.join(lines)

    return expand(stem + '.cu')


def _compiler():
    compiler = shutil.which('g++')
    if compiler is None:
        pytest.skip('g++ not found: the CPU emulation of the CUDA kernels needs it')
    return compiler


def _entries(code):
    """{kernel name: (its __launch_bounds__ or None, its parameter list)} of every extern "C"
    kernel, macro instantiations included: the preprocessor expands the source with them
    marked."""
    cmd = [_compiler(), '-x', 'c++', '-std=c++20', '-E', '-P', '-DCAFFE_SYNCBN_HOST_EMULATION',
           '-D__global__=EMU_KERNEL_ENTRY',
           '-D__launch_bounds__(...)=EMU_LAUNCH_BOUNDS(__VA_ARGS__)', '-']
    result = subprocess.run(cmd, input=code, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError('preprocessing failed:\n%s' % result.stderr[-4000:])
    return {name: (int(bound) if bound else None, params)
            for bound, name, params in _ENTRY.findall(result.stdout)}


def kernel_names(stem):
    return sorted(_entries(source(stem)))


def signatures(stem):
    """{kernel name: its cuda_signatures.Parameter tuple} of cuda/<stem>.cu."""
    return {name: cuda_signatures.parse(name, params)
            for name, (_, params) in _entries(source(stem)).items()}


def _sanitizer():
    sanitize = os.environ.get('CAFFE_SYNCBN_EMU_SANITIZE', '')
    if sanitize not in ('', 'address', 'thread'):
        raise ValueError('CAFFE_SYNCBN_EMU_SANITIZE is address or thread, not %r' % sanitize)
    return sanitize


def _build_dir():
    folder = os.environ.get('CAFFE_SYNCBN_EMU_BUILD_DIR') or os.path.join(
        tempfile.gettempdir(), 'caffe_syncbn_emu_%d' % os.getuid())
    os.makedirs(folder, exist_ok=True)
    return Path(folder)


@functools.lru_cache(maxsize=None)
def _library(stem, code, sanitize):
    """The shared library of one source text, built once per text and flags: the cache's
    file name is their hash, written under a temporary name then renamed, so parallel test
    workers share one build."""
    entries = _entries(code)
    code = ('#include "%s"\n' % HEADER + code + '\n#line 1 "<emulation launchers>"\n'
            + '\n'.join('EMULATE(%s)' % n for n in sorted(entries)) + '\n')
    # -fsanitize=alignment: the header's handler turns a misaligned vector access into an
    # error, as a GPU faults on one
    flags = ['-std=c++20', '-O1', '-shared', '-fPIC', '-pthread', '-w', '-fsanitize=alignment']
    if sanitize:
        flags += ['-g', '-fno-omit-frame-pointer', '-fsanitize=' + sanitize]
    key = hashlib.sha256('\0'.join([code, HEADER.read_text()] + flags).encode()).hexdigest()[:20]
    folder = _build_dir()
    lib = folder / ('%s_%s.so' % (stem, key))
    if not lib.exists():
        src = folder / ('%s_%s.%d.cpp' % (stem, key, os.getpid()))
        tmp = folder / ('%s_%s.%d.so' % (stem, key, os.getpid()))
        src.write_text(code)
        result = subprocess.run([_compiler()] + flags + [str(src), '-o', str(tmp)],
                                capture_output=True, text=True)
        src.unlink()
        if result.returncode != 0:
            raise RuntimeError('emulation build of cuda/%s.cu failed:\n%s'
                               % (stem, result.stderr[-4000:]))
        os.replace(tmp, lib)
    handle = ctypes.CDLL(str(lib))
    handle.emu_last_error.restype = ctypes.c_char_p
    return handle, entries


_schedule = threading.local()


def current_schedule():
    """(policy, seed): set by ``schedule()``, else CAFFE_SYNCBN_EMU_SCHEDULE."""
    chosen = getattr(_schedule, 'value', None)
    text = chosen or os.environ.get('CAFFE_SYNCBN_EMU_SCHEDULE') or 'forward'
    policy, _, seed = text.partition(':')
    if policy not in _POLICIES:
        raise ValueError('schedule policy is forward, reverse or random[:SEED], not %r' % text)
    return policy, int(seed or 0)


@contextlib.contextmanager
def schedule(text):
    """Run the launches inside the block under this policy ('forward', 'reverse',
    'random:SEED'): the order of blocks, of warps in a block and of lanes in a warp."""
    previous = getattr(_schedule, 'value', None)
    _schedule.value = text
    current_schedule()
    try:
        yield
    finally:
        _schedule.value = previous


class _Config(ctypes.Structure):
    _fields_ = [('grid', ctypes.c_uint * 3), ('block', ctypes.c_uint * 3), ('policy', ctypes.c_int),
                ('seed', ctypes.c_uint), ('kernel', ctypes.c_char_p),
                ('only_count', ctypes.c_uint), ('only_blocks', ctypes.POINTER(ctypes.c_uint))]


def _dims(value, what):
    dims = tuple(int(v) for v in (value if isinstance(value, (tuple, list)) else (value,)))
    if not 1 <= len(dims) <= 3:
        raise KernelError('%s has 1 to 3 dimensions, got %s' % (what, dims))
    return dims + (1,) * (3 - len(dims))


class EmulatedKernel:
    def __init__(self, stem, name):
        self._lib, entries = _library(stem, source(stem), _sanitizer())
        if name not in entries:
            raise AttributeError('cuda/%s.cu has no kernel %r (it has %s)'
                                 % (stem, name, sorted(entries)))
        self._bound, params = entries[name]
        try:
            self.params = cuda_signatures.parse(name, params)
        except cuda_signatures.SignatureError as error:
            raise KernelError('cuda/%s.cu: %s' % (stem, error)) from None
        prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_Config),
                                     *[p.ctype for p in self.params])
        self._launch = prototype(ctypes.c_void_p.in_dll(self._lib, 'emu_' + name).value)
        self.name = name

    def _check(self, grid, block):
        for axis, (g, b, gmax, bmax) in enumerate(zip(grid, block, MAX_GRID, MAX_BLOCK)):
            if not 1 <= g <= gmax:
                raise KernelError('%s: grid %s: grid.%s must be in [1, %d]'
                                  % (self.name, grid, 'xyz'[axis], gmax))
            if not 1 <= b <= bmax:
                raise KernelError('%s: block %s: block.%s must be in [1, %d]'
                                  % (self.name, block, 'xyz'[axis], bmax))
        threads = block[0] * block[1] * block[2]
        limit = min(MAX_THREADS, self._bound or MAX_THREADS)
        if threads > limit:
            raise KernelError('%s: block %s has %d threads, more than %d%s' % (
                self.name, block, threads, limit,
                ' (its __launch_bounds__)' if limit < MAX_THREADS else ''))

    def __call__(self, grid, block, args, blocks=None):
        """Launch over ``grid`` x ``block``; ``blocks`` (a list of (x, y, z)) runs only those
        blocks of the grid, for tests of huge grids over sparse arrays."""
        try:
            values = cuda_signatures.marshal(self.name, self.params, args)
        except cuda_signatures.SignatureError as error:
            raise KernelError(str(error)) from None
        grid, block = _dims(grid, 'grid'), _dims(block, 'block')
        self._check(grid, block)
        only = [_dims(b, 'block index') for b in blocks or ()]
        for b in only:
            if any(i >= g for i, g in zip(b, grid)):
                raise KernelError('%s: block %s is outside grid %s' % (self.name, b, grid))
        policy, seed = current_schedule()
        config = _Config((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block),
                         _POLICIES[policy], seed, self.name.encode(), len(only),
                         (ctypes.c_uint * (3 * len(only) or 1))(*[i for b in only for i in b]))
        with _LAUNCH_LOCK:
            if self._launch(ctypes.pointer(config), *values) != 0:
                raise KernelError(self._lib.emu_last_error().decode())


@functools.lru_cache(maxsize=None)
def kernel(stem, name):
    """The emulated kernel ``name`` of cuda/<stem>.cu, called as ``fn(grid, block, args)``."""
    return EmulatedKernel(stem, name)


def emulated_kernels(monkeypatch, multiprocessors=2):
    """Make caffe_syncbn.backend.cuda_kernels hand out emulated kernels over numpy arrays."""
    monkeypatch.setattr(cuda_kernels, 'kernel', lambda stem, name: EmulatedKernel(stem, name))
    monkeypatch.setattr(cuda_kernels, 'multiprocessor_count', lambda: multiprocessors)
