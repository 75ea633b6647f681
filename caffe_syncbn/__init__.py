"""caffe-syncbn: Caffe models on numpy or CuPy, trained data-parallel with synchronized BN.

The names here follow pycaffe, so ``import caffe_syncbn as caffe`` works for most scripts.
"""
import importlib

from .backend import set_device, set_mode_cpu, set_mode_gpu
from .blob import Blob
from .errors import CaffeError
from .fillers import set_random_seed
from .layer import TEST, TRAIN, Layer, LayerContext, layer_type_list, register
from .net import Net

__version__ = '0.1.0'


# Heavier parts load on first use, so `import caffe_syncbn` stays quick: {name: (module,
# attribute, or None for the module itself)}. pycaffe's `caffe.layers` is netspec.layers
# (`layers` here is the package of layer implementations); install_as_caffe() gives a
# `caffe` module with every pycaffe name.
_LAZY = {
    'NetSpec': ('.pycaffe.net_spec', 'NetSpec'), 'to_proto': ('.pycaffe.net_spec', 'to_proto'),
    'params': ('.pycaffe.net_spec', 'params'), 'net_spec': ('.pycaffe.net_spec', None),
    'get_solver': ('.training.solvers', 'get_solver'),
    'get_solver_from_string': ('.training.solvers', 'get_solver_from_string'),
    'io': ('.pycaffe.io', None), 'proto': ('.pycaffe.proto', None), 'draw': ('.pycaffe.draw', None),
    'coord_map': ('.pycaffe.coord_map', None),
    'Classifier': ('.pycaffe.classifier', 'Classifier'), 'Detector': ('.pycaffe.detector', 'Detector'),
    'install_as_caffe': ('.pycaffe.caffe', 'install_as_caffe'),
}
_LAZY.update({name: ('.pycaffe.runtime', name) for name in (
    'NCCL', 'Timer', 'has_nccl', 'init_log', 'log', 'set_multiprocess', 'set_solver_count',
    'set_solver_rank', 'solver_count', 'solver_rank')})


def __getattr__(name):
    if name in _LAZY:
        module_name, attribute = _LAZY[name]
        module = importlib.import_module(module_name, __name__)
        return module if attribute is None else getattr(module, attribute)
    if name.endswith('Solver'):     # SGDSolver ... AdamSolver: a class per registered solver type
        found = importlib.import_module('.training.solvers', __name__).solver_class_named(name)
        if found is not None:
            return found
    raise AttributeError("module 'caffe_syncbn' has no attribute %r" % name)


__all__ = ['Blob', 'CaffeError', 'Layer', 'LayerContext', 'Net', 'TEST', 'TRAIN', 'layer_type_list',
           'register', 'set_device', 'set_mode_cpu', 'set_mode_gpu', 'set_random_seed']
