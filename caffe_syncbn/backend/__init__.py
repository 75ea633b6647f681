"""Where arrays live: numpy on the CPU, CuPy on a GPU.

Layer code asks ``xp = get_array_module(x)`` and stays backend-agnostic. CuPy is
imported only when a GPU is asked for, so the CPU package never needs it.
"""
import numpy as np

from ..errors import CaffeError

_state = {'mode': 'cpu', 'device': 0}


def set_mode_cpu():
    _state['mode'] = 'cpu'


def set_mode_gpu():
    """Nets built from now on live on the GPU (``set_device`` picks which); one CaffeError
    when CuPy or a CUDA device is missing, here rather than at the first Net."""
    try:
        import cupy
    except ImportError as exc:
        raise CaffeError("set_mode_gpu() needs CuPy (pip install 'caffe-syncbn[gpu]'): %s" % exc) \
            from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:        # CuPy raises its own types for a missing driver or device
        raise CaffeError('set_mode_gpu(): CuPy finds no usable CUDA device (%s)' % exc) from None
    if count == 0:
        raise CaffeError('set_mode_gpu(): CuPy finds no CUDA device')
    _state['mode'] = 'gpu'


def set_device(device_id):
    _state['device'] = int(device_id)


def mode():
    return _state['mode']


def mode_array_module():
    """The array module that ``set_mode_cpu``/``set_mode_gpu`` chose, as pycaffe's global
    mode does: cupy (with the ``set_device`` GPU made current) or numpy."""
    if _state['mode'] != 'gpu':
        return np
    import cupy
    cupy.cuda.Device(_state['device']).use()
    return cupy


def get_array_module(*arrays):
    """numpy or cupy, whichever the given arrays belong to (numpy if unsure)."""
    for a in arrays:
        if type(a).__module__.startswith('cupy'):
            import cupy
            return cupy
    return np


def to_numpy(a):
    """A host copy (or the array itself) of a numpy or CuPy array."""
    if type(a).__module__.startswith('cupy'):
        return a.get()
    return np.asarray(a)


def gpu_count():
    """How many CUDA devices CuPy sees (0 without CuPy or without a GPU)."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:        # no CuPy, no driver, no device: all mean "no GPU here"
        return 0


def activate_gpu(index):
    """Make GPU ``index`` current for this thread, with a stream of its own."""
    import cupy
    cupy.cuda.Device(index).use()
    cupy.cuda.Stream(non_blocking=True).use()
