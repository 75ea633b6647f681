"""Every cuda/*.cu compiles for a fixed architecture without a GPU, from the exact text NVRTC
gets at run time (caffe_syncbn.backend.cuda_kernels.source), and has every kernel the Python
wrappers ask for. nvcc --ptx (then ptxas, which checks the inline PTX) when nvcc is there,
else CuPy's NVRTC when CuPy imports, else a skip that says which is missing. NVRTC with the
options CuPy gives it, from the nvidia-cuda-nvrtc wheel: tests/test_cuda_nvrtc.py."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from caffe_syncbn.backend import cuda_kernels

ROOT = Path(__file__).resolve().parents[1]
ARCH = '90'
STEMS = cuda_kernels.kernel_stems()
#: kernel_stem -> {kernel names}, from the wrappers' typed_kernel/kernel calls
_TYPED_CALL = re.compile(r"typed_kernel\(\s*'(\w+)',\s*'(\w+)'")
#: norm/gpu.py's shorthand: _kernel(base, dtype), or _kernel(base, dtype, stem) for another file
_NORM_CALL = re.compile(r"\b_kernel\(\s*'(\w+)',\s*[\w.]+(?:,\s*'(\w+)')?\)")
_NO_HALF = {'interp'}          # float16 stays on the array code (atomics)


def _nvcc():
    found = shutil.which('nvcc')
    if found:
        return found
    for candidate in ('/usr/local/cuda/bin/nvcc', '/usr/local/bin/nvcc'):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _compile_ptx(stem, tmp_path):
    """PTX text of cuda/<stem>.cu, or pytest.skip naming the missing compilers."""
    source = cuda_kernels.source(stem)
    nvcc = _nvcc()
    if nvcc is not None:
        src = tmp_path / (stem + '.cu')
        src.write_text(source)
        ptx = tmp_path / (stem + '.ptx')
        cmd = [nvcc, '--ptx', '-arch=compute_' + ARCH, '-std=c++17', str(src), '-o', str(ptx)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, 'nvcc failed on cuda/%s.cu:\n%s' % (stem, result.stderr)
        ptxas = Path(nvcc).with_name('ptxas')
        if ptxas.exists():
            result = subprocess.run([str(ptxas), '-arch=sm_' + ARCH, str(ptx), '-o',
                                     str(tmp_path / (stem + '.cubin'))], capture_output=True,
                                    text=True)
            assert result.returncode == 0, 'ptxas failed on cuda/%s.cu:\n%s' % (stem, result.stderr)
        return ptx.read_text()
    try:
        from cupy.cuda import compiler
    except ImportError:
        pytest.skip('neither nvcc nor CuPy (NVRTC) is installed: cannot compile cuda/%s.cu' % stem)
    ptx = compiler.compile_using_nvrtc(source, options=cuda_kernels.COMPILE_OPTIONS, arch=ARCH)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def wanted_kernels():
    wanted = {}
    # every module of the package, wherever its launchers live (layers/*_gpu.py, the streams)
    for path in sorted((ROOT / 'caffe_syncbn').rglob('*.py')):
        text = path.read_text()
        calls = _TYPED_CALL.findall(text) + [(stem or 'norm', base)
                                             for base, stem in _NORM_CALL.findall(text)]
        for stem, base in calls:
            suffixes = ('f32', 'f64') if stem in _NO_HALF else ('f16', 'f32', 'f64')
            wanted.setdefault(stem, set()).update('%s_%s' % (base, s) for s in suffixes)
    return wanted


def test_there_are_kernels_and_every_wrapper_names_an_existing_file():
    assert {'norm', 'eltwise', 'comm_sum', 'conv', 'pooling', 'loss', 'interp', 'lrn',
            'detection'} <= set(STEMS)
    assert set(wanted_kernels()) <= set(STEMS)


@pytest.mark.parametrize('stem', STEMS)
def test_compiles_with_the_kernels_the_wrappers_use(stem, tmp_path):
    ptx = _compile_ptx(stem, tmp_path)
    entries = set(re.findall(r'\.entry\s+(\w+)', ptx))
    missing = wanted_kernels().get(stem, set()) - entries
    assert not missing, 'cuda/%s.cu lacks kernels %s' % (stem, sorted(missing))


@pytest.mark.parametrize('stem', STEMS)
def test_opens_with_its_launch_shape(stem):
    head = (ROOT / 'cuda' / (stem + '.cu')).read_text().split('#include')[0]
    assert head.startswith('//') and 'Launch shape' in head, \
        'cuda/%s.cu must open with a comment giving its launch shape' % stem
