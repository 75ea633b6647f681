"""NetSpec: write nets in Python, as pycaffe's net_spec does.

    from caffe_syncbn.pycaffe.net_spec import NetSpec, layers as L, params as P
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 3, 8, 8]))
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=3, weight_filler=dict(type='xavier'))
    n.loss = L.SoftmaxWithLoss(n.conv, n.label)      # keyword args go to the layer's *_param
    print(n.to_proto())
"""
import collections

from .. import caffe_pb2


def _type_param_fields():
    """{layer type name: LayerParameter field} from the *_param fields' message names."""
    fields = {}
    for field in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        if field.name.endswith('_param') and field.message_type is not None:
            type_name = field.message_type.name
            if type_name.endswith('Parameter'):
                fields[type_name[:-len('Parameter')]] = field.name
    fields.update({'Deconvolution': 'convolution_param', 'SyncBN': 'bn_param',
                   'SoftmaxWithLoss': 'softmax_param', 'Im2col': 'convolution_param'})
    return fields


def _assign(message, name, value):
    """Set field ``name`` of ``message`` from a Python value, dict or list."""
    field = message.DESCRIPTOR.fields_by_name.get(name)
    if field is None:
        raise AttributeError('%s has no field %r' % (message.DESCRIPTOR.name, name))
    repeated = field.is_repeated if hasattr(field, 'is_repeated') else field.label == field.LABEL_REPEATED
    values = value if isinstance(value, (list, tuple)) else [value]
    if field.message_type is not None:
        for item in values:
            target = getattr(message, name).add() if repeated else getattr(message, name)
            for key, val in item.items():
                _assign(target, key, val)
    elif repeated:
        getattr(message, name).extend(values)
    else:
        setattr(message, name, value)


class Top:
    """One output of a layer function: what NetSpec attributes hold (``fn`` made it, as
    its output ``n``)."""

    def __init__(self, fn, n):
        self.fn, self.n = fn, n

    def to_proto(self):
        return to_proto(self)


class Function:
    """A layer call: its type, its input Tops and its keyword params."""

    def __init__(self, type_name, inputs, params):
        for i, item in enumerate(inputs):
            if not isinstance(item, Top):      # pycaffe's message, which scripts match
                raise TypeError('%s input %d is not a Top (type is %s)' % (type_name, i, type(item)))
        self.type_name, self.inputs = type_name, inputs
        self.ntop = params.pop('ntop', 1)
        self.in_place = params.pop('in_place', False)
        self.params = params
        self.tops = tuple(Top(self, i) for i in range(self.ntop))

    def _name(self, thing, names, autonames):
        """The user's name for a Function or Top, else an automatic one like Convolution3."""
        if thing not in names:
            autonames[self.type_name] += 1
            names[thing] = '%s%d' % (self.type_name, autonames[self.type_name])
        return names[thing]

    def _to_proto(self, layers, names, autonames):
        if self in layers:
            return
        bottoms = []
        for top in self.inputs:
            top.fn._to_proto(layers, names, autonames)
            bottoms.append(layers[top.fn].top[top.n])
        layer = caffe_pb2.LayerParameter(type=self.type_name)
        layer.bottom.extend(bottoms)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            layer.top.extend(self._name(t, names, autonames) for t in self.tops)
        if self not in names and self.tops:          # pycaffe names a layer after its first top
            names[self] = self._name(self.tops[0], names, autonames)
        layer.name = self._name(self, names, autonames)
        type_field = _type_param_fields().get(self.type_name)
        for key, value in self.params.items():
            if key in caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name:
                _assign(layer, key, value)
            elif type_field is not None:
                _assign(getattr(layer, type_field), key, value)
            else:
                raise AttributeError("layer type %s has no parameter %r" % (self.type_name, key))
        layers[self] = layer


def to_proto(*tops):
    """A NetParameter holding every layer needed to compute ``tops``."""
    layers, names = collections.OrderedDict(), {}
    autonames = collections.Counter()
    for top in tops:
        top.fn._to_proto(layers, names, autonames)
    net = caffe_pb2.NetParameter()
    net.layer.extend(layers.values())
    return net


class MissingTop(KeyError, AttributeError):
    """A NetSpec has no top of that name: a KeyError as in pycaffe, and an AttributeError so
    that hasattr() and copy work."""


class NetSpec:
    """Assign Tops (or a layer of ``ntop=0``) to attributes; ``to_proto()`` names layers and
    blobs after them."""

    def __init__(self):
        super().__setattr__('tops', collections.OrderedDict())

    def __setattr__(self, name, value):
        self.tops[name] = value

    def __getattr__(self, name):
        try:
            return self.tops[name]
        except KeyError:
            raise MissingTop(name) from None

    __setitem__ = __setattr__
    __getitem__ = __getattr__

    def to_proto(self):
        names = {top: name for name, top in self.tops.items()}
        functions = [top if isinstance(top, Function) else top.fn for top in self.tops.values()]
        for fn in functions:                         # a layer is named after its first top
            if fn.tops and fn.tops[0] in names:
                names.setdefault(fn, names[fn.tops[0]])
        layers = collections.OrderedDict()
        autonames = collections.Counter()
        for fn in functions:
            fn._to_proto(layers, names, autonames)
        net = caffe_pb2.NetParameter()
        net.layer.extend(layers.values())
        return net


class _LayerFactory:
    """``layers.Convolution(bottom, ...)`` builds a Function of that type."""

    def __getattr__(self, type_name):
        def make(*inputs, **params):
            fn = Function(type_name, inputs, params)
            return fn.tops[0] if fn.ntop == 1 else (fn.tops if fn.ntop > 1 else fn)
        return make


class _ParamFactory:
    """``params.Pooling.MAX``: enum values by the parameter message's short name."""

    def __getattr__(self, name):
        return getattr(caffe_pb2, name + 'Parameter')


layers = L = _LayerFactory()
params = P = _ParamFactory()
