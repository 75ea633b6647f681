"""The C signatures of the kernels in cuda/*.cu and what CuPy 14 passes for each argument of a
RawKernel launch, so that an emulated launch (cuda_emulation.py) is refused wherever the same
call would hand a GPU kernel the wrong bytes. CuPy's rules, as read from its source, are
written down in docs/gpu-emulation.md ("What a launch may pass").

``parse(kernel, text)`` reads one parameter list of the preprocessed source (macros expanded,
so every instantiation has its own); ``marshal(kernel, params, args)`` checks a launch's
arguments against it and gives the ctypes values of the emulated call.
"""
import ctypes
import re
from typing import NamedTuple

import numpy as np

#: C types of parameters and pointees that a kernel may use, to the numpy dtype of the value
#: (the pointee's, for a pointer). The last group is the project's own (cuda/common.cuh):
#: i64/u64, half_t (a float16 as its 16 bits) and acc_t<T> (float, or double for double).
C_DTYPES = {
    'bool': np.bool_, 'signed char': np.int8, 'unsigned char': np.uint8,
    'short': np.int16, 'unsigned short': np.uint16, 'int': np.int32, 'unsigned': np.uint32,
    'unsigned int': np.uint32, 'long long': np.int64, 'unsigned long long': np.uint64,
    'float': np.float32, 'double': np.float64, '__half': np.float16,
    'i64': np.int64, 'u64': np.uint64, 'half_t': np.float16, 'acc_t<half_t>': np.float32,
    'acc_t<float>': np.float32, 'acc_t<double>': np.float64,
}
C_DTYPES = {name: np.dtype(dtype) for name, dtype in C_DTYPES.items()}
#: how the emulated call passes a scalar of each dtype (a float16 travels as its bits, as the
#: one-member struct half_t does in the x86-64 calling convention)
_CTYPES = {np.dtype(np.bool_): ctypes.c_bool, np.dtype(np.int8): ctypes.c_int8,
           np.dtype(np.uint8): ctypes.c_uint8, np.dtype(np.int16): ctypes.c_int16,
           np.dtype(np.uint16): ctypes.c_uint16, np.dtype(np.int32): ctypes.c_int32,
           np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float,
           np.dtype(np.float64): ctypes.c_double, np.dtype(np.float16): ctypes.c_uint16}
_QUALIFIERS = re.compile(r'\b(?:const|volatile|__restrict__|__restrict)\b')
_PARAMETER = re.compile(r'^(.*?)\b([A-Za-z_]\w*)$')


class SignatureError(TypeError):
    """A kernel parameter whose C type has no numpy dtype here, or a launch that CuPy would
    pass wrongly."""


class Parameter(NamedTuple):
    name: str
    c_type: str         #: as the source spells it, e.g. 'const acc_t<float>*'
    pointer: bool
    dtype: np.dtype     #: the value's, or the pointee's for a pointer

    @property
    def ctype(self):
        return ctypes.c_void_p if self.pointer else _CTYPES[self.dtype]


def _split(text):
    """The parameters of a list, split at the commas outside template brackets."""
    parts, depth, start = [], 0, 0
    for at, char in enumerate(text):
        depth += {'<': 1, '>': -1}.get(char, 0)
        if char == ',' and depth == 0:
            parts.append(text[start:at])
            start = at + 1
    parts.append(text[start:])
    return [' '.join(p.split()) for p in parts if p.strip()]


def parse(kernel, text):
    """The parameters of ``kernel`` from its preprocessed parameter list ``text``."""
    if ' '.join(text.split()) in ('', 'void'):
        return ()
    params = []
    for position, declaration in enumerate(_split(text)):
        match = _PARAMETER.match(declaration)
        c_type = match.group(1).strip() if match else ''
        base = ' '.join(_QUALIFIERS.sub(' ', c_type).replace('*', ' ').split())
        base = re.sub(r'\s*([<>,])\s*', r'\1', base)
        stars = c_type.count('*')
        if base not in C_DTYPES or stars > 1 or '&' in c_type:
            raise SignatureError(
                '%s: parameter %d `%s` has a C type that the emulation cannot map to a numpy '
                'dtype (tests/helpers/cuda_signatures.py C_DTYPES knows %s, and pointers to them)'
                % (kernel, position, declaration, ', '.join(sorted(C_DTYPES))))
        params.append(Parameter(match.group(2), c_type, stars == 1, C_DTYPES[base]))
    return tuple(params)


def _cupy_scalar_dtype(value):
    """The dtype CuPy 14 gives a scalar argument (cupy/_core/_scalar.pyx): the exact Python
    types bool, int, float, complex, else a numpy scalar's own; None for what it refuses."""
    kind = type(value)
    if kind is bool:
        return np.dtype(np.bool_)
    if kind is int:
        return np.dtype(np.uint64 if value >= 2 ** 63 else np.int64)
    if kind is float:
        return np.dtype(np.float64)
    if kind is complex:
        return np.dtype(np.complex128)
    if isinstance(value, np.generic):
        return value.dtype
    return None


def _described(value):
    if value is None:
        return 'None'
    kind = type(value)
    if kind in (bool, int, float, complex):
        return 'a Python %s' % kind.__name__
    if isinstance(value, np.generic):
        return 'np.%s' % value.dtype.name
    if isinstance(value, np.ndarray):
        return 'an array of %s, shape %s' % (value.dtype.name, value.shape)
    return 'a %s' % kind.__name__


def _sized(dtype):
    return '%s (%d byte%s)' % (dtype.name, dtype.itemsize, 's' if dtype.itemsize > 1 else '')


def _refusal(value, param):
    """Why CuPy would pass ``value`` wrongly for ``param``, or None where it is right."""
    if value is None:
        return None if param.pointer else \
            'CuPy passes None as a null pointer (8 zero bytes), not a %s' % param.dtype.name
    if isinstance(value, np.ndarray):
        if not param.pointer:
            return ('CuPy passes an array (a 0-d one too) as a pointer, not by value: pass '
                    'np.%s(value)' % param.dtype.name)
        if value.dtype != param.dtype:
            return ('the kernel reads %s values through this pointer: CuPy passes the data '
                    'pointer as it is, so the bytes would be read as the wrong type'
                    % param.dtype.name)
        if not value.flags.c_contiguous:
            return ('a strided view: CuPy passes its raw data pointer, and the kernel would '
                    'read the memory as contiguous')
        return None
    if type(value) is int and not -2 ** 63 <= value < 2 ** 64:
        return 'CuPy refuses a Python int outside int64 and uint64 (OverflowError)'
    dtype = _cupy_scalar_dtype(value)
    if dtype is None:
        return 'CuPy 14 passes no kernel argument of this type (TypeError: Unsupported type)'
    if param.pointer:
        return 'CuPy passes it by value as %s, not as a pointer' % dtype.name
    if dtype != param.dtype:
        return 'CuPy passes it as %s where the kernel reads %s: pass np.%s(value)' % (
            _sized(dtype), _sized(param.dtype), param.dtype.name)
    return None


def marshal(kernel, params, args):
    """The ctypes values of a launch's ``args``, after checking each against ``params`` as
    CuPy would pass it; SignatureError names the first argument that CuPy would pass wrongly."""
    args = tuple(args)
    if len(args) != len(params):
        raise SignatureError('%s takes %d arguments (%s), got %d' % (
            kernel, len(params), ', '.join(p.name for p in params), len(args)))
    values = []
    for position, (value, param) in enumerate(zip(args, params)):
        reason = _refusal(value, param)
        if reason is not None:
            raise SignatureError('%s: args[%d] `%s %s` got %s: %s' % (
                kernel, position, param.c_type, param.name, _described(value), reason))
        if param.pointer:
            values.append(ctypes.c_void_p(None if value is None else value.ctypes.data))
        elif param.dtype == np.float16:
            values.append(ctypes.c_uint16(int(np.float16(value).view(np.uint16))))
        else:
            values.append(param.ctype(value.item() if isinstance(value, np.generic) else value))
    return values
