"""The ``Python`` layer: a user class, subclass of caffe_syncbn.Layer, named by python_param.

As in Caffe, ``module`` is imported from sys.path and ``layer`` names the class; the
class sees ``self.param_str`` before its ``setup`` runs.
"""
import importlib

from ..errors import layer_error
from ..layer import register


@register('Python')
def python_layer(param, ctx):
    spec = param.python_param
    try:
        module = importlib.import_module(spec.module)
    except ImportError as exc:
        raise layer_error(param, "cannot import python_param module '%s': %s" % (spec.module, exc)) \
            from None
    cls = getattr(module, spec.layer, None)
    if cls is None:
        raise layer_error(param, "module '%s' has no class '%s'" % (spec.module, spec.layer))
    layer = cls(param, ctx)
    layer.param_str = spec.param_str
    return layer
