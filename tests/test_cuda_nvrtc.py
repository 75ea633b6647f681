"""Every cuda/*.cu compiles with NVRTC, the compiler CuPy's RawModule runs on a user's GPU,
with the options CuPy 14 gives it for our COMPILE_OPTIONS on a compute capability 9.0 device,
and no GPU: libnvrtc from the nvidia-cuda-nvrtc wheel (the test extra), called through ctypes.
Its PTX must hold every kernel the emulation and the wrappers know, with parameters of the sizes
and kinds that the emulation's signature check (tests/helpers/cuda_signatures.py) reads from the
source.

Without the wheel the tests skip with a line; with the wheel, a libnvrtc that does not load
fails them. docs/gpu-emulation.md, "NVRTC".
"""
import ctypes
import functools
import importlib.metadata
import re
import shutil

import pytest

from helpers import cuda_emulation
from caffe_syncbn.backend import cuda_kernels
from test_cuda_compile import wanted_kernels

WHEEL = 'nvidia-cuda-nvrtc'
ARCH = '90'
_LIBRARY = re.compile(r'libnvrtc\.so(\.\d+)*$')
_ENTRY = re.compile(r'\.entry\s+(\w+)\s*\(([^)]*)\)')
_PARAM = re.compile(r'\.param\s+(?:\.align\s+\d+\s+)?\.([a-z]+)(\d+)\s+\w+(?:\[(\d+)\])?')


class Program(ctypes.Structure):
    """nvrtcProgram, an opaque handle."""


_HANDLE = ctypes.POINTER(Program)


@functools.lru_cache(maxsize=None)
def nvrtc():
    """libnvrtc of the installed wheel, with the prototypes these tests call."""
    try:
        wheel = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip('the %s wheel is not installed (pip install -e .[test] brings it): '
                    'the kernels are not compiled with NVRTC' % WHEEL)
    found = [f for f in wheel.files or () if _LIBRARY.match(f.name)]
    if not found:
        pytest.fail('%s %s is installed but holds no libnvrtc.so' % (WHEEL, wheel.version),
                    pytrace=False)
    try:
        lib = ctypes.CDLL(str(wheel.locate_file(found[0])))
    except OSError as error:
        pytest.fail('%s %s is installed but its libnvrtc does not load: %s'
                    % (WHEEL, wheel.version, error), pytrace=False)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(_HANDLE), ctypes.c_char_p, ctypes.c_char_p,
                                       ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.nvrtcCompileProgram.argtypes = [_HANDLE, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(_HANDLE)]
    for what in ('ProgramLog', 'PTX', 'CUBIN'):
        getattr(lib, 'nvrtcGet%sSize' % what).argtypes = [_HANDLE, ctypes.POINTER(ctypes.c_size_t)]
        getattr(lib, 'nvrtcGet%s' % what).argtypes = [_HANDLE, ctypes.c_char_p]
    return lib


def cupy_options(options=cuda_kernels.COMPILE_OPTIONS, arch=ARCH):
    """NVRTC's options for a RawModule(code=..., options=options) under CuPy 14 on a device of
    compute capability ``arch``: the C++17 default where ``options`` names no standard, then
    -ftz=true, the real architecture (CuPy asks NVRTC for a cubin where NVRTC knows the device)
    and --device-as-default-execution-space. CuPy's include paths (CCCL, its own headers, the
    CUDA headers) are left out: the kernels include nothing, and must not start to."""
    if not any('-std=' in o for o in options):
        options += ('--std=c++17',)
    return tuple(options) + ('-ftz=true', '-arch=sm_' + arch, '--device-as-default-execution-space')


def _output(lib, program, what):
    size = ctypes.c_size_t()
    assert getattr(lib, 'nvrtcGet%sSize' % what)(program, ctypes.byref(size)) == 0
    data = ctypes.create_string_buffer(size.value)
    assert getattr(lib, 'nvrtcGet%s' % what)(program, data) == 0
    return data.raw[:size.value]


def compile_nvrtc(stem):
    """(PTX text, cubin) of cuda/<stem>.cu as CuPy compiles it. The source is the loader's text
    with #line marks (cuda_emulation.source), so an error names the .cu or .cuh file and its
    line; test_the_compiled_text_is_what_cupy_gets holds it to the loader's."""
    lib = nvrtc()
    program = _HANDLE()
    name = 'cuda/%s.cu' % stem
    assert lib.nvrtcCreateProgram(ctypes.byref(program), cuda_emulation.source(stem).encode(),
                                  name.encode(), 0, None, None) == 0
    try:
        options = [o.encode() for o in cupy_options()]
        status = lib.nvrtcCompileProgram(program, len(options),
                                         (ctypes.c_char_p * len(options))(*options))
        log = _output(lib, program, 'ProgramLog').rstrip(b'\0').decode(errors='replace').strip()
        if status != 0:
            pytest.fail('NVRTC failed on %s (%s, options %s):\n%s' % (
                name, lib.nvrtcGetErrorString(status).decode(), ' '.join(cupy_options()), log),
                pytrace=False)
        return _output(lib, program, 'PTX').rstrip(b'\0').decode(), _output(lib, program, 'CUBIN')
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def ptx_parameters(ptx):
    """{kernel: [(bytes, is_float) of each parameter]} from the PTX's .entry lines."""
    entries = {}
    for name, params in _ENTRY.findall(ptx):
        entries[name] = [(int(count) if count else int(bits) // 8, kind == 'f')
                         for kind, bits, count in _PARAM.findall(params)]
    return entries


def _expected(param):
    if param.pointer:
        return (8, False)
    return (param.dtype.itemsize, param.dtype.kind == 'f' and param.dtype.itemsize >= 4)


@pytest.mark.parametrize('stem', cuda_kernels.kernel_stems())
def test_compiles_as_cupy_compiles_it(stem):
    ptx, cubin = compile_nvrtc(stem)
    assert cubin[:4] == b'\x7fELF', 'NVRTC gave no sm_%s cubin for cuda/%s.cu' % (ARCH, stem)
    compiled = ptx_parameters(ptx)
    signatures = cuda_emulation.signatures(stem)
    assert set(compiled) == set(signatures), \
        'cuda/%s.cu: NVRTC compiled %s, the emulation found %s' % (
            stem, sorted(compiled), sorted(signatures))
    missing = wanted_kernels().get(stem, set()) - set(compiled)
    assert not missing, 'cuda/%s.cu lacks kernels %s' % (stem, sorted(missing))
    for name, params in signatures.items():
        read = [_expected(p) for p in params]
        assert compiled[name] == read, (
            '%s: NVRTC laid out its parameters as %s (bytes, floating), the emulation reads %s'
            ' from the source' % (name, compiled[name], read))


@pytest.mark.parametrize('stem', cuda_kernels.kernel_stems())
def test_the_compiled_text_is_what_cupy_gets(stem):
    """cuda_emulation.source is the loader's text with #line marks, and nothing else."""
    def lines(text):
        return [line.rstrip() for line in text.splitlines()
                if line.strip() and not line.startswith('#line ')]
    assert lines(cuda_emulation.source(stem)) == lines(cuda_kernels.source(stem))


@pytest.mark.parametrize('file, line, broken', [
    ('lrn.cu', 'const A s = (A)k + (A)alpha_over_size * window;',
     'const A s = (A)k + (A)alpha_over_size * windw;'),
    ('common.cuh', 'template <class T> using acc_t = typename acc_type<T>::type;',
     'template <class T> using acc_t = typename acc_type<T>::typo;'),
])
def test_an_error_names_the_file_and_line(tmp_path, monkeypatch, file, line, broken):
    nvrtc()
    for source in cuda_kernels.cuda_dir().iterdir():
        shutil.copy(source, tmp_path / source.name)
    text = (tmp_path / file).read_text()
    assert text.count(line) == 1
    number = 1 + text.split(line)[0].count('\n')
    (tmp_path / file).write_text(text.replace(line, broken))
    monkeypatch.setenv('CAFFE_SYNCBN_EMU_CUDA_DIR', str(tmp_path))
    with pytest.raises(pytest.fail.Exception) as failure:
        compile_nvrtc('lrn')
    assert 'cuda/%s(%d): error' % (file, number) in str(failure.value), str(failure.value)



def test_an_installed_wheel_whose_library_does_not_load_fails(tmp_path, monkeypatch):
    """Where the wheel is installed (CI: the test extra), a libnvrtc that does not load fails
    the tests instead of skipping them."""
    info = tmp_path / 'nvidia_cuda_nvrtc-13.0.0.dist-info'
    info.mkdir()
    (info / 'METADATA').write_text('Metadata-Version: 2.1\nName: %s\nVersion: 13.0.0\n' % WHEEL)
    (info / 'RECORD').write_text('nvidia/cu13/lib/libnvrtc.so.13,,\n')
    folder = tmp_path / 'nvidia' / 'cu13' / 'lib'
    folder.mkdir(parents=True)
    (folder / 'libnvrtc.so.13').write_bytes(b'not a shared library')
    monkeypatch.syspath_prepend(str(tmp_path))
    message = 'nvidia-cuda-nvrtc 13.0.0 is installed but its libnvrtc does not load'
    with pytest.raises(pytest.fail.Exception, match=message):
        nvrtc.__wrapped__()


def test_without_the_wheel_the_tests_skip(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, 'distribution', missing)
    with pytest.raises(pytest.skip.Exception, match='the nvidia-cuda-nvrtc wheel is not installed'):
        nvrtc.__wrapped__()
