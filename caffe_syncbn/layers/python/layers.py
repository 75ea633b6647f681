"""The ``Python`` layer: a user class, subclass of caffe_syncbn.Layer, named by python_param.

As in Caffe, ``module`` is imported from sys.path and ``layer`` names the class; the
class sees ``self.param_str`` before its ``setup`` runs. sys.path holds the current
folder for scripts and ``python -m``, so a prototxt runs the code of the folder it is
used from (see docs/bad-input.md). Only a Layer subclass is called.
"""
import importlib

from ...errors import layer_error, quote
from ...layer import Layer, register


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
    if cls is None:
        raise layer_error(param, 'module %s has no class %s' % (quote(spec.module),
                                                                quote(spec.layer)))
    if not (isinstance(cls, type) and issubclass(cls, Layer)):
        raise layer_error(param, 'python_param %s.%s is %s, not a subclass of caffe.Layer'
                          % (quote(spec.module, quotes=False), quote(spec.layer, quotes=False),
                             quote(_kind(cls), quotes=False)))
    layer = cls(param, ctx)
    layer.param_str = spec.param_str
    return layer


def _kind(value):
    """'a function', 'a class', 'an int', ...: what a name in a module is."""
    name = 'class' if isinstance(value, type) else type(value).__name__
    name = 'function' if name in ('builtin_function_or_method', 'method') else name
    return ('an ' if name[0] in 'aeiou' else 'a ') + name
