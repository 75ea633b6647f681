"""The GPU path without a GPU: a CPU emulation of the CUDA runtime, strict where a GPU is.

``emulated_gpu(monkeypatch)`` puts ``EmulatedCudaRuntime`` under the 'gpu' kind of
caffe_syncbn.backend.device.RUNTIMES, so that ``gpu:0,0`` solvers, ``set_mode_gpu()`` and
every launcher of caffe_syncbn run here: their arrays are ``DeviceArray``s over numpy, their
kernels the g++ emulation of cuda/*.cu (cuda_emulation.py), their communicators the
same-device one (or NCCL's stand-in, fake_nccl.py) over emulated streams.

What it holds the code to, as CuPy and a GPU would:

- **Host and device arrays do not mix.** ``np.asarray(device_array)`` raises TypeError, as
  CuPy's does; so does an operation between a device array and a numpy array, and an
  operation on arrays of two devices.
- **Streams are not ordered with each other** unless a synchronize or an event orders
  them. Every operation on a device array is an operation on the calling thread's current
  stream of the array's device (the legacy null stream until ``activate``). ``StreamOrder``
  keeps, per array, the last write and the reads since, with each stream's knowledge of
  the others (vector clocks), and raises ``UnorderedAccess`` at the first access that
  nothing orders after a conflicting one on another stream: the access that on a GPU
  could see stale data or be overwritten by a late kernel. It runs everything at once in
  host order, so the values are those of one legal order; the check is about the others.
- **Reading a device value on the host is a synchronization**, counted:
  ``StreamOrder.host_reads`` counts ``get()``, ``float()``, ``int()``, ``bool()``,
  ``item()`` and ``tolist()`` of device arrays, the transfers that stall a GPU's queue.

What it does not see: timing, memory limits, and races inside a kernel (cuda_emulation.py
and the sanitizers cover kernels).
"""
import functools
import threading
import weakref

import numpy as np
from helpers import cuda_emulation

from helpers import fake_nccl
from caffe_syncbn.backend import cuda_kernels, device


class UnorderedAccess(AssertionError):
    """Two streams touched one array with nothing ordering them."""


# ---- streams and their order -------------------------------------------------------------------
class EmulatedStream:
    def __init__(self, order, name, device_index):
        self.order, self.name, self.device = order, name, device_index
        self.epoch = 0
        #: {stream: epoch}: the work of other streams this stream's next work comes after
        self.known = {}

    def synchronize(self):
        self.order.synchronize(self)

    def wait_event(self, event):
        self.order.wait_event(self, event)

    def __enter__(self):
        self.order.push(self)
        return self

    def __exit__(self, *exc):
        self.order.pop()

    def __repr__(self):
        return "stream '%s'" % self.name


class EmulatedEvent:
    """What a stream had done when the event was recorded on it."""

    def __init__(self, order, clock):
        self.order, self.clock = order, clock
        self.done = True

    def synchronize(self):
        self.order.host_learns(self.clock)


class _Access:
    """The last write of one array's memory and the reads since, as (stream, epoch)."""
    __slots__ = ('write', 'reads', 'what')

    def __init__(self, what):
        self.write, self.reads, self.what = None, {}, what


class StreamOrder:
    """The streams of the emulated devices and what orders their work (module docstring)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._local = threading.local()
        self._null = {}
        self._accesses = {}
        #: {stream: epoch} the host has waited for: whatever it enqueues comes after. One
        #: for every thread: the threads that hand arrays over are ordered on the host
        #: (the worker pool's calls), so what one waited for, the next one knows.
        self.host_known = {}
        self.host_reads = 0

    # -- which stream a thread's work goes to
    def null_stream(self, index):
        with self._lock:
            if index not in self._null:
                self._null[index] = EmulatedStream(self, 'null stream of gpu:%d' % index, index)
            return self._null[index]

    def current_device(self):
        return getattr(self._local, 'device', 0)

    def select(self, index):
        self._local.device = index

    def current_stream(self, index=None):
        index = self.current_device() if index is None else index
        return getattr(self._local, 'streams', {}).get(index) or self.null_stream(index)

    def use(self, stream):
        if not hasattr(self._local, 'streams'):
            self._local.streams = {}
        self._local.streams[stream.device] = stream

    def push(self, stream):
        """``with stream:``: current in this thread until ``pop``."""
        if not hasattr(self._local, 'pushed'):
            self._local.pushed = []
        self._local.pushed.append(self.current_stream(stream.device))
        self.use(stream)

    def pop(self):
        self.use(self._local.pushed.pop())

    def new_stream(self, index, name=None):
        return EmulatedStream(self, name or '%s on gpu:%d' % (threading.current_thread().name,
                                                              index), index)

    # -- ordering
    def _merge(self, into, clock):
        for stream, epoch in clock.items():
            if into.get(stream, 0) < epoch:
                into[stream] = epoch

    def _clock(self, stream):
        clock = dict(stream.known)
        clock[stream] = stream.epoch
        return clock

    def synchronize(self, stream):
        with self._lock:
            self._merge(self.host_known, self._clock(stream))

    def host_learns(self, clock):
        with self._lock:
            self._merge(self.host_known, clock)

    def record_event(self, stream):
        with self._lock:
            stream.epoch += 1
            self._merge(stream.known, self.host_known)
            return EmulatedEvent(self, self._clock(stream))

    def wait_event(self, stream, event):
        with self._lock:
            self._merge(stream.known, event.clock)

    # -- accesses
    def access(self, root, stream, write, what):
        """One operation of ``stream`` on the memory of ``root`` (an array's owner)."""
        with self._lock:
            stream.epoch += 1
            self._merge(stream.known, self.host_known)
            key = id(root)
            state = self._accesses.get(key)
            if state is None:
                state = self._accesses[key] = _Access(what)
                weakref.finalize(root, self._accesses.pop, key, None)
            earlier = [state.write] if state.write else []
            if write:
                earlier += list(state.reads.items())
            for other, epoch in earlier:
                if other is not stream and stream.known.get(other, 0) < epoch:
                    raise UnorderedAccess(
                        '%s of %s on %s is not ordered after its %s on %s: nothing (a '
                        'synchronize, an event) makes the one wait for the other, so on a GPU '
                        'it may run first' % ('a write' if write else 'a read', state.what,
                                              stream, 'write' if (other, epoch) == state.write
                                              else 'read', other))
            if write:
                state.write, state.reads = (stream, stream.epoch), {}
            else:
                state.reads[stream] = stream.epoch

    def host_read(self):
        with self._lock:
            self.host_reads += 1


# ---- device arrays ------------------------------------------------------------------------------
class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr


class _DeviceScope:
    """``array.device``: its index, and a ``with`` that makes it current."""

    def __init__(self, order, index):
        self.order, self.id = order, index

    def __enter__(self):
        self._previous = self.order.current_device()
        self.order.select(self.id)
        return self

    def __exit__(self, *exc):
        self.order.select(self._previous)


class DeviceArray(np.lib.mixins.NDArrayOperatorsMixin):
    """A numpy array on an emulated device (see the module docstring)."""

    # methods that write into their array; all others read it
    _WRITERS = frozenset(['fill', 'sort', 'put', 'partition', 'itemset', 'resize'])

    def __init__(self, raw, module, device_index, root=None):
        self._raw, self._module, self._device = raw, module, device_index
        #: the array that owns the memory (itself, unless it is a view)
        self._root = self if root is None else root

    # -- what the tracker needs
    def _touch(self, write):
        order = self._module.order
        order.access(self._root, order.current_stream(self._device), write,
                     'an array of shape %s' % (self._root._raw.shape,))

    def _derived(self, raw):
        """``raw``, from an operation on this array, as a device array (EmulatedCupy.wrap)."""
        return self._module.wrap(raw, [self])

    # -- attributes
    shape = property(lambda self: self._raw.shape)
    dtype = property(lambda self: self._raw.dtype)
    ndim = property(lambda self: self._raw.ndim)
    size = property(lambda self: self._raw.size)
    itemsize = property(lambda self: self._raw.itemsize)
    nbytes = property(lambda self: self._raw.nbytes)
    strides = property(lambda self: self._raw.strides)
    flags = property(lambda self: self._raw.flags)
    data = property(lambda self: _Pointer(self._raw.ctypes.data))
    device = property(lambda self: _DeviceScope(self._module.order, self._device))
    base = property(lambda self: None if self._root is self else self._root)
    T = property(lambda self: self._derived(self._raw.T))

    def __len__(self):
        return len(self._raw)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self):
        return 'DeviceArray(gpu:%d, %r)' % (self._device, self._raw)

    __hash__ = None

    # -- host transfers: each is a synchronization of the current stream
    def get(self, stream=None, out=None):
        self._touch(write=False)
        order = self._module.order
        order.host_read()
        order.synchronize(stream or order.current_stream(self._device))
        copy = self._raw.copy()
        if out is not None:
            out[...] = copy
            return out
        return copy

    def _scalar(self):
        if self.size != 1:
            raise ValueError('only one element of a device array converts to a Python scalar')
        return self.get().reshape(())[()]

    def __float__(self):
        return float(self._scalar())

    def __int__(self):
        return int(self._scalar())

    def __index__(self):
        return int(self._scalar())

    def __bool__(self):
        return bool(self._scalar())

    def item(self):
        return self._scalar().item()

    def tolist(self):
        return self.get().tolist()

    def __array__(self, *args, **kwargs):
        raise TypeError('a device array does not turn into a numpy array by itself (CuPy '
                        'refuses it too): copy it to the host with .get()')

    # -- operations
    def __getitem__(self, key):
        key = self._module.index(key)
        raw = self._raw[key]
        if not (isinstance(raw, np.ndarray) and np.may_share_memory(raw, self._raw)):
            self._touch(write=False)            # advanced indexing: a gather kernel
        return self._derived(raw)

    def __setitem__(self, key, value):
        key = self._module.index(key)
        value = self._module.operand(value, self._device, host_ok=True)
        self._touch(write=True)
        self._raw[key] = value

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return self._module.run(getattr(ufunc, method), inputs, kwargs,
                                writes_first=method == 'at')

    def __array_function__(self, func, types, args, kwargs):
        return self._module.run(func, args, kwargs,
                                writes_first=func in self._module.WRITE_FIRST)

    def __getattr__(self, name):
        if name.startswith('_'):
            raise AttributeError(name)
        method = getattr(self._raw, name)
        if not callable(method):
            raise AttributeError('DeviceArray has no %r' % name)

        @functools.wraps(method)
        def call(*args, **kwargs):
            module = self._module
            args = [module.operand(a, self._device) for a in args]
            out = kwargs.get('out')
            kwargs = {k: module.operand(v, self._device) for k, v in kwargs.items()}
            self._touch(write=name in self._WRITERS)
            if isinstance(out, DeviceArray):
                out._touch(write=True)
            result = method(*args, **kwargs)
            if isinstance(out, DeviceArray):
                return out
            return self._derived(result) if isinstance(result, (np.ndarray, np.generic)) \
                else result
        return call


# ---- the array module -----------------------------------------------------------------------------
class EmulatedCupy:
    """The array module of the emulated devices: numpy's functions over DeviceArrays."""

    #: numpy functions whose first argument they write into
    WRITE_FIRST = frozenset([np.copyto, np.put, np.place, np.putmask, np.fill_diagonal])
    _CREATORS = frozenset(['zeros', 'ones', 'empty', 'full', 'arange', 'eye', 'identity',
                           'linspace', 'array', 'asarray', 'ascontiguousarray', 'asanyarray'])

    def __init__(self, order):
        self.order = order
        self.ndarray = DeviceArray
        self.cuda = _CudaNamespace(order)
        self.lib = _Namespace(self, np.lib)

    def adopt(self, raw):
        """New device memory on the current device holding ``raw``, written by the current
        stream."""
        index = self.order.current_device()
        if isinstance(raw, np.generic):
            raw = np.asarray(raw)
        array = DeviceArray(raw, self, index)
        array._touch(write=True)
        return array

    def operand(self, value, device_index, host_ok=False):
        """``value`` as numpy code takes it: a DeviceArray's numpy array (of the same device);
        Python and numpy scalars as they are; lists and tuples element by element."""
        if isinstance(value, DeviceArray):
            if value._device != device_index:
                raise ValueError('the array is on gpu:%d, the operation on gpu:%d (peer access '
                                 'is not enabled)' % (value._device, device_index))
            return value._raw
        if isinstance(value, np.ndarray) and not host_ok:
            raise TypeError('a numpy array of shape %s cannot be an operand of a device '
                            'operation (copy it with xp.asarray first)' % (value.shape,))
        if isinstance(value, (list, tuple)):
            return type(value)(self.operand(v, device_index, host_ok) for v in value)
        return value

    def index(self, key):
        """An index for numpy: device index arrays read on their device."""
        if isinstance(key, tuple):
            return tuple(self.index(k) for k in key)
        if isinstance(key, DeviceArray):
            key._touch(write=False)
            return key._raw
        return key

    def run(self, func, args, kwargs, writes_first=False):
        """``func(*args, **kwargs)`` of numpy over device arrays: every device array it reads
        and writes is an access of the current stream; the result is device memory."""
        arrays = [a for a in _flatten(list(args) + list(kwargs.values()))
                  if isinstance(a, DeviceArray)]
        index = arrays[0]._device if arrays else self.order.current_device()
        out = kwargs.get('out')
        outs = [a for a in _flatten([out]) if isinstance(a, DeviceArray)]
        for k, a in enumerate(arrays):
            written = any(a is o for o in outs) or (writes_first and k == 0 and a is args[0])
            a._touch(write=written)
        raw_args = [self.operand(a, index) for a in args]
        raw_kwargs = {k: self.operand(v, index) for k, v in kwargs.items()}
        result = func(*raw_args, **raw_kwargs)
        if out is not None:        # a ufunc's out is a tuple; one output returns alone
            return out[0] if isinstance(out, tuple) and len(out) == 1 else out
        return self.wrap(result, arrays)

    def wrap(self, result, inputs):
        """numpy's ``result`` of an operation on the device arrays ``inputs``: a view of
        one's memory where it shares it, else new memory of the current device."""
        if isinstance(result, (tuple, list)):
            return type(result)(self.wrap(r, inputs) for r in result)
        if not isinstance(result, (np.ndarray, np.generic)):
            return result
        for a in inputs:
            if isinstance(result, np.ndarray) and result.size and \
                    np.may_share_memory(result, a._raw):
                return DeviceArray(result, self, a._device, a._root)
        return self.adopt(result)

    def __getattr__(self, name):
        value = getattr(np, name)
        if isinstance(value, np.ufunc):
            return _Ufunc(self, value)
        if name in self._CREATORS:
            return functools.partial(self._create, value)
        if callable(value) and not isinstance(value, type):
            return self.function(value)
        if isinstance(value, type(np)):
            return _Namespace(self, value)
        return value

    def function(self, func):
        """numpy's ``func`` over device arrays (``run``)."""
        return functools.wraps(func)(lambda *args, **kwargs: self.run(func, args, kwargs))

    def _create(self, func, *args, **kwargs):
        """A constructor: of device arrays as numpy's function of them; of host data (lists,
        numpy arrays), a copy on the device."""
        if any(isinstance(a, DeviceArray) for a in _flatten(args)):
            return self.run(func, args, kwargs)
        raw = func(*args, **kwargs)
        if args and isinstance(args[0], np.ndarray) and np.may_share_memory(raw, args[0]):
            raw = raw.copy()                 # device memory of its own, not the host's
        return self.adopt(raw)


class _Ufunc:
    """A numpy ufunc called through the emulated module: device operands only."""

    def __init__(self, module, ufunc):
        self._module, self._ufunc = module, ufunc

    def __call__(self, *args, **kwargs):
        return self._module.run(self._ufunc, args, kwargs)

    def reduce(self, *args, **kwargs):
        return self._module.run(self._ufunc.reduce, args, kwargs)

    def accumulate(self, *args, **kwargs):
        return self._module.run(self._ufunc.accumulate, args, kwargs)

    def at(self, *args, **kwargs):
        return self._module.run(self._ufunc.at, args, kwargs, writes_first=True)

    def __getattr__(self, name):
        return getattr(self._ufunc, name)


class _Namespace:
    def __init__(self, module, namespace):
        self._module, self._namespace = module, namespace

    def __getattr__(self, name):
        value = getattr(self._namespace, name)
        if isinstance(value, type(np)):
            return _Namespace(self._module, value)
        if callable(value) and not isinstance(value, type):
            return self._module.function(value)
        return value


class _CudaNamespace:
    """What the package asks of ``cupy.cuda``."""

    def __init__(self, order):
        self._order = order

    def get_current_stream(self):
        return self._order.current_stream()


def _flatten(items):
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from _flatten(item)
        else:
            yield item


# ---- the runtime -------------------------------------------------------------------------------------
class EmulatedStreams:
    """What the device communicators need of a device (CupyStreams' methods), on emulated
    streams: every operation runs at once, and counts as an access of the stream it is
    enqueued on."""

    def __init__(self, module, index):
        self.module, self.order, self.device = module, module.order, index

    def is_device_array(self, array):
        return isinstance(array, DeviceArray)

    def current_stream(self):
        return self.order.current_stream(self.device)

    def record_event(self, stream):
        return self.order.record_event(stream)

    def wait_event(self, stream, event):
        self.order.wait_event(stream, event)

    def new_stream(self):
        return self.order.new_stream(self.device, 'side stream of %s'
                                     % threading.current_thread().name)

    def handle(self, stream):
        return stream

    def pointer(self, array):
        return array._raw.ctypes.data

    def event_done(self, event):
        return True

    def wait_host(self, event):
        event.synchronize()

    def to_device(self, array):
        with _DeviceScope(self.order, self.device):
            return self.module.asarray(array)

    def to_host(self, array, out):
        out[...] = array.get(stream=self.current_stream())

    def empty(self, size, dtype, stream):
        with _DeviceScope(self.order, self.device), stream:
            return self.module.empty(size, dtype)

    def _on(self, stream, reads, writes):
        for array in reads:
            self.order.access(array._root, stream, False, 'a communicator buffer')
        for array in writes:
            self.order.access(array._root, stream, True, 'a communicator buffer')

    def sum_into(self, out, arrays, stream):
        self._on(stream, arrays, [out])
        total = arrays[0]._raw.reshape(-1).copy()
        for a in arrays[1:]:
            total += a._raw.reshape(-1)
        out._raw[...] = total

    def copy(self, dst, src, stream):
        self._on(stream, [src], [dst])
        dst._raw.reshape(-1)[...] = src._raw.reshape(-1)

    def device_scope(self):
        return _DeviceScope(self.order, self.device)


class EmulatedCudaRuntime:
    """The 'gpu' runtime of caffe_syncbn.backend.device, emulated (module docstring)."""

    def __init__(self, devices=2):
        self.order = StreamOrder()
        self.module = EmulatedCupy(self.order)
        self.devices = devices

    def array_module(self):
        return self.module

    def owns(self, array):
        return isinstance(array, DeviceArray)

    def to_host(self, array):
        return array.get()

    def count(self):
        return self.devices

    def name(self, index):
        return 'emulated GPU %d (CPU)' % index

    def activate(self, index):
        self.order.select(index)
        self.order.use(self.order.new_stream(index))

    def select(self, index):
        self.order.select(index)

    def current_index(self):
        return self.order.current_device()

    def synchronize(self, index):
        self.order.synchronize(self.order.current_stream(index))

    def streams(self, index):
        return EmulatedStreams(self.module, index)

    def nccl(self):
        return fake_nccl


class _TrackedKernel:
    """An emulated kernel whose array arguments are accesses of the current stream (all
    written, as the launch alone does not say which it only reads)."""

    def __init__(self, kernel):
        self._kernel = kernel

    def __call__(self, grid, block, args, **kwargs):
        raw = []
        for a in args:
            if isinstance(a, DeviceArray):
                a._touch(write=True)
                raw.append(a._raw)
            elif isinstance(a, np.ndarray):
                raise TypeError('kernel %s got a numpy array: kernels take device arrays'
                                % self._kernel.name)
            else:
                raw.append(a)
        return self._kernel(grid, block, tuple(raw), **kwargs)


_building = threading.Lock()


@functools.lru_cache(maxsize=None)
def _tracked_kernel(stem, name):
    with _building:         # replicas' threads ask at once; the first builds, the others wait
        return _TrackedKernel(cuda_emulation.kernel(stem, name))


def emulated_gpu(monkeypatch, devices=2):
    """Run the 'gpu' devices on the emulation for the rest of the test; the runtime."""
    runtime = EmulatedCudaRuntime(devices)
    monkeypatch.setitem(device.RUNTIMES, 'gpu', runtime)
    monkeypatch.setattr(cuda_kernels, 'kernel', _tracked_kernel)
    monkeypatch.setattr(cuda_kernels, 'multiprocessor_count', lambda: 2)
    return runtime
