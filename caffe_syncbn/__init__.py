"""caffe-syncbn: Caffe models on numpy or CuPy, trained data-parallel with synchronized BN.

The names here follow pycaffe, so ``import caffe_syncbn as caffe`` works for most scripts.
"""
from .backend import set_device, set_mode_cpu, set_mode_gpu
from .blob import Blob
from .errors import CaffeError
from .fillers import set_random_seed
from .layer import TEST, TRAIN, Layer, LayerContext, layer_type_list, register
from .net import Net

__version__ = '0.1.0'


def __getattr__(name):
    # Heavier parts load on first use, so `import caffe_syncbn` stays quick.
    # pycaffe's `caffe.layers`/`caffe.params` live in caffe_syncbn.netspec (`layers` here is
    # the package of layer implementations).
    if name in ('NetSpec', 'to_proto'):
        from . import netspec
        return getattr(netspec, name)
    if name == 'get_solver':
        from . import training
        return training.get_solver
    if name in ('SGDSolver', 'NesterovSolver', 'AdaGradSolver', 'RMSPropSolver', 'AdaDeltaSolver',
                'AdamSolver'):
        from . import solvers
        return getattr(solvers, name)
    if name == 'io':
        import importlib
        return importlib.import_module('.io', __name__)
    raise AttributeError("module 'caffe_syncbn' has no attribute %r" % name)


__all__ = ['Blob', 'CaffeError', 'Layer', 'LayerContext', 'Net', 'TEST', 'TRAIN', 'layer_type_list',
           'register', 'set_device', 'set_mode_cpu', 'set_mode_gpu', 'set_random_seed']
