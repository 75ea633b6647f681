"""Every emulated launch is checked against its kernel's C signature with CuPy 14's rules for
RawKernel arguments (tests/helpers/cuda_signatures.py; docs/gpu-emulation.md, "What a launch may
pass"): what CuPy passes rightly runs, with the values the kernel reads; what it would pass
wrongly is a KernelError naming the kernel, the argument, the C type and the Python type."""
import enum
import re

import numpy as np
import pytest

from helpers import cuda_emulation
from caffe_syncbn.backend import cuda_kernels
from helpers.cuda_emulation import KernelError, kernel

_LRN = 'lrn_across_forward_f32'
#: echoes its scalars into a float64 array: what the kernel reads of each marshalled value
_ECHO = r'''#include "common.cuh"
extern "C" __global__ void echo(bool b, unsigned char c, int i, unsigned u, i64 q, u64 w,
                                float f, double d, half_t h, acc_t<double> a, double* out) {
    const double read[] = {(double)b, (double)c, (double)i, (double)u, (double)q, (double)w,
                           (double)f, d, (double)to_float(h), a};
    for (int k = 0; k < 10; ++k) out[k] = read[k];
}
extern "C" __global__ void takes_float(float f, float* out) { out[0] = f; }
'''


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """Builds kernels from source text in a scratch cuda folder (common.cuh copied in)."""
    monkeypatch.setenv('CAFFE_SYNCBN_EMU_CUDA_DIR', str(tmp_path))
    (tmp_path / 'common.cuh').write_text((cuda_emulation.ROOT / 'cuda' / 'common.cuh').read_text())

    def build(code, name, stem='scratch'):
        (tmp_path / (stem + '.cu')).write_text(code)
        return cuda_emulation.EmulatedKernel(stem, name)
    return build


def _lrn_args(**change):
    """lrn_across_forward_f32(x, N, C, HW, size, alpha_over_size, beta, k, scale, y) on a
    (2, 5, 3) input, with numpy scalars of the parameters' own types."""
    args = dict(x=np.linspace(-1, 1, 30, dtype=np.float32), N=np.int32(2), C=np.int32(5),
                HW=np.int64(3), size=np.int32(3), alpha_over_size=np.float64(1e-4 / 3),
                beta=np.float64(0.75), k=np.float64(1.0), scale=np.full(30, np.nan, np.float32),
                y=np.full(30, np.nan, np.float32))
    args.update(change)
    return args


def _launch(args):
    kernel('lrn', _LRN)((1,), (32,), tuple(args.values()))
    return args['y']


def test_what_cupy_passes_rightly_runs_as_with_numpy_scalars():
    """A Python int is an int64 (HW is i64) and a Python float a float64 (the doubles), as CuPy
    passes them; the results equal those of numpy scalars."""
    want = _launch(_lrn_args())
    assert np.isfinite(want).all()
    got = _launch(_lrn_args(HW=3, alpha_over_size=1e-4 / 3, beta=0.75, k=1.0))
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize('change, message', [
    (dict(x=np.zeros(30, np.float64)),
     '%s: args[0] `const float* x` got an array of float64, shape (30,): the kernel reads float32 '
     'values through this pointer' % _LRN),
    (dict(y=np.full(60, np.nan, np.float32)[::2]),
     "args[9] `float* y` got an array of float32, shape (30,): a strided view: CuPy passes its raw "
     "data pointer"),
    (dict(N=2),
     '%s: args[1] `int N` got a Python int: CuPy passes it as int64 (8 bytes) where the kernel '
     'reads int32 (4 bytes): pass np.int32(value)' % _LRN),
    (dict(C=np.int64(5)),
     'args[2] `int C` got np.int64: CuPy passes it as int64 (8 bytes) where the kernel reads '
     'int32 (4 bytes)'),
    (dict(HW=np.int32(3)), 'args[3] `i64 HW` got np.int32: CuPy passes it as int32 (4 bytes) '
     'where the kernel reads int64 (8 bytes)'),
    (dict(beta=np.float32(0.75)), 'args[6] `double beta` got np.float32'),
    (dict(k=1), 'args[7] `double k` got a Python int: CuPy passes it as int64 (8 bytes) where '
     'the kernel reads float64'),
    (dict(size=True), 'args[4] `int size` got a Python bool: CuPy passes it as bool (1 byte)'),
    (dict(N=None), 'args[1] `int N` got None: CuPy passes None as a null pointer'),
    (dict(N=np.array(2, np.int32)),
     'args[1] `int N` got an array of int32, shape (): CuPy passes an array (a 0-d one too) as a '
     'pointer'),
    (dict(scale=np.float32(0)), 'args[8] `float* scale` got np.float32: CuPy passes it by value as '
     'float32, not as a pointer'),
    (dict(N=enum.IntEnum('Count', 'two')(1)),
     'args[1] `int N` got a Count: CuPy 14 passes no kernel argument of this type'),
    (dict(HW=2 ** 63), 'args[3] `i64 HW` got a Python int: CuPy passes it as uint64'),
    (dict(HW=2 ** 64), 'CuPy refuses a Python int outside int64 and uint64'),
])
def test_what_cupy_would_pass_wrongly_is_refused(change, message):
    args = _lrn_args(**change)
    with pytest.raises(KernelError, match=re.escape(message)):
        _launch(args)
    assert np.isnan(args['y']).all(), 'the refused launch ran'


def test_the_argument_count_is_checked():
    args = list(_lrn_args().values())
    fn = kernel('lrn', _LRN)
    message = ('%s takes 10 arguments (x, N, C, HW, size, alpha_over_size, beta, k, scale, y), '
               'got 9' % _LRN)
    with pytest.raises(KernelError, match=re.escape(message)):
        fn((1,), (32,), tuple(args[:-1]))
    with pytest.raises(KernelError, match='got 11'):
        fn((1,), (32,), tuple(args + [None]))


def test_a_null_pointer_is_none():
    fn = kernel('comm_sum', 'reduce_sum8_f32')
    a, b, dst = np.arange(8, dtype=np.float32), np.ones(8, np.float32), np.zeros(8, np.float32)
    fn((1,), (32,), (a, b) + (None,) * 6 + (np.int32(2), np.int32(0), dst, 8))
    assert dst.tolist() == (a + b).tolist()


def test_each_scalar_reaches_the_kernel_with_its_width(scratch):
    """Values that need every byte of their type (and a float16 by value, as its bits): a
    scalar marshalled at the wrong width or in the wrong register reads back wrong."""
    fn = scratch(_ECHO, 'echo')
    out = np.full(10, np.nan)
    values = [True, np.uint8(200), np.int32(-2 ** 31 + 5), np.uint32(2 ** 32 - 7), -2 ** 40 - 3,
              np.uint64(2 ** 63 + 2 ** 20), np.float32(1.1), 2.0 ** -1070, np.float16(-0.333),
              np.float64(3.25)]
    fn((1,), (1,), values + [out])
    want = [1, 200, -2 ** 31 + 5, 2 ** 32 - 7, -2 ** 40 - 3, 2 ** 63 + 2 ** 20,
            float(np.float32(1.1)), 2.0 ** -1070, float(np.float16(-0.333)), 3.25]
    assert out.tolist() == want


def test_a_python_float_for_a_float_is_refused(scratch):
    """CuPy passes a Python float as a double: a float parameter would read half of it."""
    fn = scratch(_ECHO, 'takes_float')
    out = np.zeros(1, np.float32)
    with pytest.raises(KernelError, match=re.escape(
            'takes_float: args[0] `float f` got a Python float: CuPy passes it as float64 '
            '(8 bytes) where the kernel reads float32 (4 bytes): pass np.float32(value)')):
        fn((1,), (1,), (0.5, out))
    fn((1,), (1,), (np.float32(0.5), out))
    assert out[0] == 0.5


def test_a_parameter_type_without_a_dtype_is_named(scratch):
    code = ('#include "common.cuh"\nstruct Pair { int a, b; };\n'
            'extern "C" __global__ void by_struct(Pair p, int* out) { out[0] = p.a; }\n')
    with pytest.raises(KernelError, match=re.escape(
            'cuda/odd.cu: by_struct: parameter 0 `Pair p` has a C type that the emulation '
            'cannot map to a numpy dtype')):
        scratch(code, 'by_struct', stem='odd')


@pytest.mark.parametrize('stem', cuda_kernels.kernel_stems())
def test_every_kernel_has_a_signature_the_check_reads(stem):
    """Each parameter of every kernel in cuda/ maps to a dtype (parse raises otherwise)."""
    signatures = cuda_emulation.signatures(stem)
    assert signatures and all(signatures.values()), signatures
