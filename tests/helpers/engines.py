"""One layer test on every engine, as Caffe's TestDtypesAndDevices runs each test on every
dtype and device (conftest.py's ``engine`` fixture):

- ``array``: the family's array engine (its array.py, the contract the others keep), on numpy;
- ``host``: the host engine the layer picks on numpy (its host.py); skipped for a layer
  whose family has none, as it runs the array engine there;
- ``cuda-emulated``: the layer on the CPU emulation of the GPU runtime (emulated_gpu.py):
  device arrays, strict streams, the kernels of cuda/ built for the CPU;
- ``gpu``: the layer on CuPy, on a GPU; skipped without one.

A family's engines are the modules array.py, host.py and gpu.py of its package under
caffe_syncbn/layers/; a layer picks one in setup, as Caffe's layer factory picks CUDNN or
CAFFE, and holds it as ``layer.engine``. A layer with one way to run runs its code on each
device all the same.
"""
import contextlib
import importlib

import numpy as np
import pytest

from caffe_syncbn import testing
from caffe_syncbn.blob import Blob
from caffe_syncbn.layer import TRAIN, LayerContext, create_layer
from helpers import emulated_gpu

NAMES = ('array', 'host', 'cuda-emulated', 'gpu')
#: the engines of the host, where finite differences run (the host_engine fixture)
HOST_NAMES = ('array', 'host')
#: the module of a family that each engine runs
MODULES = {'array': 'array', 'host': 'host', 'cuda-emulated': 'gpu', 'gpu': 'gpu'}
#: how closely float32 and float16 results follow the float64 array engine
TOLERANCE = {np.float64: 1e-10, np.float32: 2e-5, np.float16: 2e-2}


def family_module(layer, kind):
    """The module ``kind`` (array, host, gpu) of the layer's family, or None."""
    package = type(layer).__module__.rpartition('.')[0]
    try:
        return importlib.import_module('%s.%s' % (package, kind))
    except ModuleNotFoundError:
        return None


def _cupy():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:               # no CuPy, no driver or no device: the run has no GPU
        pass
    pytest.skip('no GPU: CuPy does not see one')


class Engine:
    """Builds layers that run one engine, and reads their arrays back on the host."""

    def __init__(self, name, monkeypatch):
        self.name = name
        if name == 'gpu':
            self.xp = _cupy()
        elif name == 'cuda-emulated':
            self.xp = emulated_gpu.emulated_gpu(monkeypatch).array_module()
        else:
            self.xp = np

    def __repr__(self):
        return self.name

    @property
    def on_device(self):
        return self.xp is not np

    def build(self, param, bottoms, phase=TRAIN, dtype=np.float64, seed=0):
        """As caffe_syncbn.testing.build_layer, on this engine's arrays and with its engine."""
        param = testing.layer_param(param)
        ctx = LayerContext(phase=phase, xp=self.xp, dtype=dtype, rng=np.random.RandomState(seed))
        layer = create_layer(param, ctx)
        bottom = []
        for array in bottoms:
            blob = Blob(np.shape(array), dtype, self.xp)
            blob.data[...] = self.xp.asarray(np.asarray(array, dtype))
            bottom.append(blob)
        top = [Blob((), dtype, self.xp) for _ in param.top]
        layer.setup(bottom, top)
        self._choose(layer)
        layer.reshape(bottom, top)
        return layer, bottom, top

    def _choose(self, layer):
        if not hasattr(layer, 'engine'):
            if self.name == 'host':
                pytest.skip('%s has one engine: the array run covers the host' % layer.type)
            return
        wanted = family_module(layer, MODULES[self.name])
        if self.name == 'array':
            if wanted is None:
                pytest.skip('the family of %s has no array engine' % layer.type)
            layer.engine = wanted
        elif self.name == 'host' and (wanted is None or layer.engine is not wanted):
            pytest.skip('%s runs no host engine here: the array run covers the host' % layer.type)

    def forward(self, layer, bottom, top):
        """layer.forward, then the checks it left for the device (LayerContext.check_later),
        raised as the Net raises them with the pass's loss."""
        layer.forward(bottom, top)
        checks, layer.ctx.pending_checks = layer.ctx.pending_checks, []
        for failed, failing, message in checks:
            if bool(failed):
                raise failing.error(message())

    def host(self, array):
        """``array`` as a numpy array."""
        if self.xp is np:
            return np.asarray(array)
        return array.get()

    def run(self, param, bottoms, params=None, top_diffs=None, propagate_down=None, phase=TRAIN,
            dtype=np.float64, seed=0):
        """Forward with the layer's blobs set to ``params`` (standard normal values of seed 3
        when None: fillers draw differently in each dtype), then backward from ``top_diffs``
        (of seed 7 when None): {'top': tops, 'bottom_diff': bottom diffs, 'param_diff':
        param diffs}, on the host as float64."""
        layer, bottom, top = self.build(param, bottoms, phase, dtype, seed)
        if params is None:
            rs = np.random.RandomState(3)
            params = [rs.standard_normal(b.shape) for b in layer.blobs]
        for blob, values in zip(layer.blobs, params):
            blob.data[...] = self.xp.asarray(np.asarray(values, dtype))
        self.forward(layer, bottom, top)
        result = {'top': [self.host(t.data).astype(np.float64) for t in top]}
        if top_diffs is None:
            rs = np.random.RandomState(7)
            top_diffs = [rs.standard_normal(t.shape) for t in top]
        for t, diff in zip(top, top_diffs):
            t.diff[...] = self.xp.asarray(np.asarray(diff, dtype))
        for b in list(bottom) + list(layer.blobs):
            b.diff[...] = 0
        if propagate_down is None:
            propagate_down = [True] * len(bottom)
        layer.backward(top, propagate_down, bottom)
        result['bottom_diff'] = [self.host(b.diff).astype(np.float64) for b, down
                                 in zip(bottom, propagate_down) if down]
        result['param_diff'] = [self.host(b.diff).astype(np.float64) for b in layer.blobs]
        return result

    def check_gradient(self, param, bottoms, **kwargs):
        """caffe_syncbn.testing.check_gradient on this engine (float64 on the host: finite
        differences need the precision and read the arrays element by element)."""
        if self.on_device:
            pytest.skip('finite differences run on the host engines')
        with _building_with(self):
            return testing.check_gradient(param, bottoms, **kwargs)


@contextlib.contextmanager
def _building_with(engine):
    """testing.build_layer building on ``engine`` for the block."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(testing, 'build_layer', lambda param, bottoms, phase=TRAIN,
                      dtype=np.float64, seed=0: engine.build(param, bottoms, phase, dtype, seed))
        yield


def reference(param, bottoms, **kwargs):
    """Engine.run by the float64 array engine: what every engine is held to."""
    with pytest.MonkeyPatch.context() as patch:
        return Engine('array', patch).run(param, bottoms, dtype=np.float64, **kwargs)


def assert_matches(got, want, dtype, what=''):
    """Every array of Engine.run's ``got`` within TOLERANCE[dtype] of ``want``, relative to
    the largest value of its array."""
    tolerance = TOLERANCE[np.dtype(dtype).type]
    for key in ('top', 'bottom_diff', 'param_diff'):
        assert len(got[key]) == len(want[key]), (what, key)
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            scale = max(1.0, float(np.abs(b).max())) if b.size else 1.0
            np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance * scale,
                                       err_msg='%s %s %d' % (what, key, i))
