"""The precisions a net may run in (``-precision``): float32, or mixed precision, in which
the activations and their diffs are float16 or bfloat16 while the params, their diffs and
updates, every batch-norm statistic and every allreduce stay float32.

numpy holds float16 itself; bfloat16 comes from ml_dtypes (the numpy dtype that JAX and
TensorFlow share; the ``bfloat16`` extra), loaded only when asked for. CuPy has no
bfloat16, so bfloat16 runs on the CPU alone.
"""
import numpy as np

from .errors import CaffeError

#: the names ``-precision`` takes, the default first
PRECISIONS = ('float32', 'float16', 'bfloat16')
#: the one float type of params, inputs, labels and losses in every precision
FULL = np.dtype(np.float32)


def check_precision(name, where='-precision'):
    """``name`` if it is one of PRECISIONS; else one CaffeError naming ``where``."""
    if name not in PRECISIONS:
        raise CaffeError('%s %s: expected one of %s' % (where, name, ', '.join(PRECISIONS)))
    return name


def activation_dtype(name):
    """The dtype of a precision's activations: float32, float16, or ml_dtypes' bfloat16."""
    check_precision(name)
    if name != 'bfloat16':
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError as exc:
        raise CaffeError("-precision bfloat16 needs ml_dtypes (pip install "
                         "'caffe-syncbn[bfloat16]'): %s" % exc) from None
    return np.dtype(ml_dtypes.bfloat16)


def run_dtypes(precision, dtype=None):
    """(full dtype, activation dtype) of nets run in ``precision``, whose full dtype the
    caller may set (``dtype``: float64 for checks) under float32 alone."""
    check_precision(precision)
    full = np.dtype(dtype or FULL)
    if precision == 'float32':
        return full, full
    if full != FULL:
        raise CaffeError('-precision %s keeps the params in float32, not %s' % (precision, full))
    return full, activation_dtype(precision)


def is_half(dtype):
    """Whether ``dtype`` is a 16-bit float (float16 or bfloat16), which the layers' engines
    on the host compute in float32 and store back."""
    dtype = np.dtype(dtype)
    return dtype == np.float16 or dtype.name == 'bfloat16'


def precision_name(dtype):
    """The PRECISIONS name of an activation dtype."""
    return 'bfloat16' if np.dtype(dtype).name == 'bfloat16' else np.dtype(dtype).name
