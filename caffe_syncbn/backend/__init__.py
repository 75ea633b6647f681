"""Where arrays live: numpy on the CPU, CuPy on a GPU (device.py: devices and runtimes).

Layer code asks ``xp = get_array_module(x)`` and stays backend-agnostic. CuPy is
imported only when a GPU is asked for, so the CPU package never needs it.
"""
from ..errors import CaffeError
from .device import RUNTIMES, Device, runtime_of

__all__ = ['Device', 'get_array_module', 'gpu_count', 'mode',
           'mode_array_module', 'set_device', 'set_mode_cpu', 'set_mode_gpu', 'to_numpy']

_state = {'mode': 'cpu', 'device': 0}


def set_mode_cpu():
    _state['mode'] = 'cpu'


def set_mode_gpu():
    """Nets built from now on live on the GPU (``set_device`` picks which); one CaffeError
    when CuPy or a CUDA device is missing, here rather than at the first Net."""
    try:
        RUNTIMES['gpu'].array_module()
    except ImportError as exc:
        raise CaffeError("set_mode_gpu() needs CuPy (pip install 'caffe-syncbn[gpu]'): %s" % exc) \
            from None
    if RUNTIMES['gpu'].count() == 0:
        raise CaffeError('set_mode_gpu(): CuPy finds no usable CUDA device')
    _state['mode'] = 'gpu'


def set_device(device_id):
    _state['device'] = int(device_id)


def mode():
    return _state['mode']


def mode_array_module():
    """The array module that ``set_mode_cpu``/``set_mode_gpu`` chose, as pycaffe's global
    mode does: the GPU's (with the ``set_device`` GPU made current) or numpy."""
    device = Device(_state['mode'], _state['device'])
    device.runtime.select(device.index)
    return device.xp


def get_array_module(*arrays):
    """numpy or cupy, whichever the given arrays belong to (numpy if unsure)."""
    for a in arrays:
        runtime = runtime_of(a)
        if runtime is not RUNTIMES['cpu']:
            return runtime.array_module()
    return RUNTIMES['cpu'].array_module()


def to_numpy(a):
    """A host copy (or the array itself) of a numpy or device array."""
    return runtime_of(a).to_host(a)


def gpu_count():
    """How many GPUs there are (0 without CuPy or without a GPU)."""
    return RUNTIMES['gpu'].count()
