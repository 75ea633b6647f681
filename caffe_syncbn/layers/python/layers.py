"""The ``Python`` layer: a user class, subclass of caffe_syncbn.Layer, named by python_param.

As in Caffe, ``module`` is imported from sys.path and ``layer`` names the class; the
class sees ``self.param_str`` before its ``setup`` runs. sys.path holds the current
folder for scripts and ``python -m``, so a prototxt runs the code of the folder it is
used from (see docs/bad-input.md). Only a Layer subclass that defines reshape and
forward is called.
"""
import importlib

from ...errors import layer_error, quote
from ...forks import origin_of_python_module
from ...layer import Layer, register

#: the methods a Python layer's class must define: caffe.Layer's own raise NotImplementedError
_CONTRACT = ('reshape', 'forward')


@register('Python')
def python_layer(param, ctx):
    spec = param.python_param
    if not spec.module or not spec.layer:
        raise layer_error(param, 'python_param needs a module and a layer (class) name, got '
                                 'module %s, layer %s' % (quote(spec.module), quote(spec.layer)))
    if not all(part.isidentifier() for part in spec.module.split('.')):
        raise layer_error(param, 'python_param module %s is not a module name: give the dotted '
                                 'name an import statement takes, found on sys.path, not a path '
                                 'or a relative name' % quote(spec.module))
    try:
        module = importlib.import_module(spec.module)
    except ImportError as exc:
        origin = origin_of_python_module(spec.module)
        raise layer_error(param, 'cannot import python_param module %s: %s%s'
                          % (quote(spec.module), quote(exc, quotes=False),
                             '; it is %s' % origin if origin else '')) from None
    cls = getattr(module, spec.layer, None)
    if cls is None:
        raise layer_error(param, 'module %s has no class %s' % (quote(spec.module),
                                                                quote(spec.layer)))
    if not (isinstance(cls, type) and issubclass(cls, Layer)):
        raise layer_error(param, 'python_param %s.%s is %s, not a subclass of caffe.Layer'
                          % (quote(spec.module, quotes=False), quote(spec.layer, quotes=False),
                             quote(_kind(cls), quotes=False)))
    missing = [name for name in _CONTRACT if getattr(cls, name) is getattr(Layer, name)]
    if missing:
        raise layer_error(param, 'python_param %s.%s does not implement %s of the layer contract'
                                 '%s' % (quote(spec.module, quotes=False),
                                         quote(spec.layer, quotes=False), ' and '.join(missing),
                                         ': it is caffe.Layer itself' if cls is Layer else ''))
    layer = cls(param, ctx)
    layer.param_str = spec.param_str
    return layer


def _kind(value):
    """'a function', 'a class', 'an int', ...: what a name in a module is."""
    name = 'class' if isinstance(value, type) else type(value).__name__
    name = 'function' if name in ('builtin_function_or_method', 'method') else name
    return ('an ' if name[0] in 'aeiou' else 'a ') + name
