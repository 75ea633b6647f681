"""pycaffe's ``caffe.draw``: a net's graph in Graphviz's DOT language, and rendered.

Layers are boxes named ``name (Type)`` with kernel size, stride and pad for convolutions and
poolings (and learning-rate multipliers with ``display_lrm``), coloured by kind; blobs are
grey octagons; edges into a blob carry the layer's output count (num_output, batch size).
``.dot``, ``.gv`` and ``.raw`` files hold the DOT text itself; other formats (png, svg, jpg,
...) run Graphviz's ``dot``, or ``graphviz-pure`` (``pip install 'caffe-syncbn[draw]'``).
``get_pydot_graph`` needs pydot.
"""
import os
import shutil
import subprocess
import sys
import warnings

from .. import caffe_pb2
from ..errors import CaffeError
from ..formats.atomic import atomic_write
from ..netparam.upgrade import load_net_param

BLOB_STYLE = {'shape': 'octagon', 'fillcolor': '#E0E0E0', 'style': 'filled'}
NEURON_LAYER_STYLE = {'shape': 'record', 'fillcolor': '#90EE90', 'style': 'filled'}
LAYER_COLORS = {'Convolution': '#FF5050', 'Deconvolution': '#FF5050', 'Pooling': '#FF9900',
                'InnerProduct': '#CC33FF'}
DEFAULT_LAYER_COLOR = '#6495ED'
TEXT_FORMATS = ('dot', 'gv', 'raw')


def get_pooling_types_dict():
    """{PoolMethod number: name}, e.g. {0: 'MAX', 1: 'AVE', 2: 'STOCHASTIC'}."""
    return {v.number: name for name, v in
            caffe_pb2.PoolingParameter.PoolMethod.DESCRIPTOR.values_by_name.items()}


def get_edge_label(layer):
    """The label of the edges into a layer's tops: its output count where it has one."""
    if layer.type == 'Data':
        return 'Batch %d' % layer.data_param.batch_size
    if layer.type in ('Convolution', 'Deconvolution'):
        return str(layer.convolution_param.num_output)
    if layer.type == 'InnerProduct':
        return str(layer.inner_product_param.num_output)
    return ''


def get_layer_lr_mult(layer):
    """(weight lr_mult, bias lr_mult) of a Convolution, Deconvolution or InnerProduct."""
    if layer.type not in ('Convolution', 'Deconvolution', 'InnerProduct'):
        raise CaffeError('%s layers have no learning rate multipliers to draw' % layer.type)
    if len(layer.param) > 2:
        raise CaffeError("layer '%s' has %d param specs; a %s has at most 2"
                         % (layer.name, len(layer.param), layer.type))
    mults = [spec.lr_mult for spec in layer.param] + [1.0, 1.0]
    return mults[0], mults[1]


def get_layer_label(layer, rankdir, display_lrm=False):
    """A layer box's text: name, (type), then spatial settings and lr multipliers. Lines are
    DOT's ``\\n`` escapes for a horizontal layout (LR/RL), spaces for a vertical one."""
    separator = ' ' if rankdir in ('TB', 'BT') else r'\n'
    kind = layer.type
    if kind == 'Pooling':
        kind += ' ' + get_pooling_types_dict()[layer.pooling_param.pool]
    lines = [_escape(layer.name, record=True), '(%s)' % kind]
    if layer.type in ('Convolution', 'Deconvolution', 'Pooling'):
        if layer.type == 'Pooling':
            p = layer.pooling_param
            kernel, stride, pad = p.kernel_size, p.stride, p.pad
        else:
            p = layer.convolution_param
            kernel, stride, pad = (values[0] if len(values) else default for values, default in
                                   ((p.kernel_size, 1), (p.stride, 1), (p.pad, 0)))
        lines += ['kernel size: %d' % kernel, 'stride: %d' % stride, 'pad: %d' % pad]
    if display_lrm and layer.type in ('Convolution', 'Deconvolution', 'InnerProduct'):
        weight_mult, bias_mult = get_layer_lr_mult(layer)
        if weight_mult or bias_mult:
            lines.append('lr mult: %.1f, %.1f' % (weight_mult, bias_mult))
    return separator.join(lines)


def choose_color_by_layertype(layertype):
    return LAYER_COLORS.get(layertype, DEFAULT_LAYER_COLOR)


def _escape(text, record=False):
    """Text safe inside a DOT quoted string (and a record label, whose {}|<> are fields)."""
    text = text.replace('\\', '\\\\').replace('"', '\\"')
    if record:
        for char in '{}|<>':
            text = text.replace(char, '\\' + char)
    return text


def _attributes(attrs):
    return ', '.join('%s="%s"' % (key, value) for key, value in attrs.items())


def _in_phase(layer, phase):
    """pycaffe's phase filter: include/exclude rules by phase alone (a rule without a phase
    matches every phase); None keeps every layer."""
    if phase is None:
        return True
    if len(layer.include) and len(layer.exclude):
        raise CaffeError("layer '%s' has both include and exclude rules" % layer.name)

    def matches(rule):
        return not rule.HasField('phase') or rule.phase == phase

    if len(layer.include):
        return any(matches(rule) for rule in layer.include)
    return not any(matches(rule) for rule in layer.exclude)


def _as_net_param(caffe_net):
    """A V2 NetParameter from a NetParameter (V1 ones upgraded) or a prototxt path."""
    if not isinstance(caffe_net, caffe_pb2.NetParameter):
        caffe_net = os.fspath(caffe_net)
    return load_net_param(caffe_net)


def get_dot_source(caffe_net, rankdir='LR', label_edges=True, phase=None, display_lrm=False):
    """The net's graph as DOT text (see the module's docstring for what is drawn)."""
    net = _as_net_param(caffe_net)
    lines = ['digraph "%s" {' % _escape(net.name or 'Net'), 'rankdir="%s";' % rankdir]
    blobs, edges = [], []
    for index, layer in enumerate(net.layer):
        if not _in_phase(layer, phase):
            continue
        node = 'layer%d' % index
        in_place = len(layer.bottom) == 1 and list(layer.bottom) == list(layer.top)
        style = dict(NEURON_LAYER_STYLE) if in_place else {
            'shape': 'record', 'fillcolor': choose_color_by_layertype(layer.type), 'style': 'filled'}
        lines.append('"%s" [label="%s", %s];' % (node, get_layer_label(layer, rankdir, display_lrm),
                                                 _attributes(style)))
        edge_label = _escape(get_edge_label(layer)) if label_edges else ''
        for name in layer.bottom:
            blobs.append(name)
            edges.append('"blob_%s" -> "%s" [label=""];' % (_escape(name), node))
        for name in layer.top:
            blobs.append(name)
            edges.append('"%s" -> "blob_%s" [label="%s"];' % (node, _escape(name), edge_label))
    for name in dict.fromkeys(blobs):
        lines.append('"blob_%s" [label="%s", %s];' % (_escape(name), _escape(name),
                                                      _attributes(BLOB_STYLE)))
    return '\n'.join(lines + edges + ['}', ''])


def get_pydot_graph(caffe_net, rankdir, label_edges=True, phase=None, display_lrm=False):
    """The net's graph as a pydot.Dot (for scripts that style or write it themselves)."""
    try:
        import pydot
    except ImportError:
        raise CaffeError("get_pydot_graph needs pydot: pip install 'caffe-syncbn[draw]'") from None
    source = get_dot_source(caffe_net, rankdir, label_edges, phase, display_lrm)
    with warnings.catch_warnings():      # pydot's parser still calls pyparsing's deprecated names
        warnings.simplefilter('ignore', DeprecationWarning)
        return pydot.graph_from_dot_data(source)[0]


def dot_program():
    """Graphviz's ``dot`` on PATH, else ``graphviz-pure`` (on PATH or beside this Python)."""
    beside = os.path.join(os.path.dirname(sys.executable), 'graphviz-pure')
    found = shutil.which('dot') or shutil.which('graphviz-pure') or (
        beside if os.access(beside, os.X_OK) else None)
    if found is None:
        raise CaffeError("drawing images needs Graphviz's dot or graphviz-pure (pip install "
                         "'caffe-syncbn[draw]'); .dot/.gv/.raw files need neither")
    return found


def draw_net(caffe_net, rankdir, ext='png', phase=None, display_lrm=False):
    """The net drawn as the bytes of an ``ext`` file (png, svg, jpg, ..., or dot/gv/raw text).

    ``caffe_net``: a NetParameter (or a prototxt path); ``rankdir``: 'LR', 'RL', 'TB' or 'BT';
    ``phase``: caffe.TRAIN or caffe.TEST to draw that phase's layers only (None: all)."""
    source = get_dot_source(caffe_net, rankdir, phase=phase, display_lrm=display_lrm)
    if ext in TEXT_FORMATS:
        return source.encode()
    program = dot_program()
    try:
        result = subprocess.run([program, '-T' + ext], input=source.encode(), capture_output=True,
                                check=False)
    except OSError as exc:
        raise CaffeError('cannot run %s: %s' % (program, exc.strerror or exc)) from None
    if result.returncode != 0 or not result.stdout:
        message = result.stderr.decode(errors='replace').strip().splitlines()
        raise CaffeError('%s could not draw the net as %r: %s'
                         % (program, ext, message[0] if message else 'exit %d' % result.returncode))
    return result.stdout


def draw_net_to_file(caffe_net, filename, rankdir='LR', phase=None, display_lrm=False):
    """Draw the net into ``filename``, in the format its extension names (atomically)."""
    filename = os.fspath(filename)
    ext = filename.rsplit('.', 1)[-1] if '.' in os.path.basename(filename) else ''
    if not ext:
        raise CaffeError('draw_net_to_file: %s has no extension to choose the format by' % filename)
    image = draw_net(caffe_net, rankdir, ext, phase, display_lrm)
    with atomic_write(filename) as f:
        f.write(image)
