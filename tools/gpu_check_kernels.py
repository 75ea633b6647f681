#!/usr/bin/env python3
"""The compile-kernels step of `make gpu-check` (tools/gpu_check.py): every module of cuda/
compiled once, in this one process, into CuPy's kernel cache (CUPY_CACHE_DIR), so that the
later steps' processes (pytest's workers, the trainings, the benchmarks) load each module from
the cache instead of each compiling it (cold, the nine modules take 18 s on 2 cores).

CuPy keys its cache on the source text and the options, so a module compiled here is found
there only if both are the ones the layers ask for: both come from
caffe_syncbn.backend.cuda_kernels.
"""
import os
import sys
import time

import cupy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from caffe_syncbn.backend import cuda_kernels  # noqa: E402


def compile_all(say):
    """Compile every module of cuda_kernels.kernel_stems() for the current device."""
    for stem in cuda_kernels.kernel_stems():
        start = time.monotonic()
        cupy.RawModule(code=cuda_kernels.source(stem),
                       options=cuda_kernels.COMPILE_OPTIONS).compile()
        say('%s: compiled in %.1f s' % (stem, time.monotonic() - start))


def main():
    start = time.monotonic()
    cache = os.environ.get('CUPY_CACHE_DIR', '~/.cupy/kernel_cache (CuPy\'s default)')
    compile_all(lambda line: print(line, flush=True))
    print('compiled %d modules in %.1f s into %s' % (
        len(cuda_kernels.kernel_stems()), time.monotonic() - start, cache), flush=True)


if __name__ == '__main__':
    main()
