"""The ``Python`` layer: a user class, subclass of caffe_syncbn.Layer, named by python_param.

As in Caffe, ``module`` is imported from sys.path and ``layer`` names the class; the
class sees ``self.param_str`` before its ``setup`` runs.
"""
import importlib

from ..errors import layer_error, quote
from ..layer import register


@register('Python')
def python_layer(param, ctx):
    spec = param.python_param
    if not spec.module or not spec.layer:
        raise layer_error(param, 'python_param needs a module and a layer (class) name, got '
                                 'module %s, layer %s' % (quote(spec.module), quote(spec.layer)))
    try:
        module = importlib.import_module(spec.module)
    except ImportError as exc:
        raise layer_error(param, 'cannot import python_param module %s: %s'
                          % (quote(spec.module), quote(exc, quotes=False))) from None
    except ValueError:            # importlib's "Empty module name", relative names
        raise layer_error(param, 'python_param module %s is not a module name'
                          % quote(spec.module)) from None
    cls = getattr(module, spec.layer, None)
    if not callable(cls):
        raise layer_error(param, 'module %s has no class %s' % (quote(spec.module),
                                                                quote(spec.layer)))
    layer = cls(param, ctx)
    layer.param_str = spec.param_str
    return layer
