"""Where a layer stands in its prototxt, for errors that name the net file and the line.

A parsed NetParameter has no line numbers, so the text is scanned for its top-level
``layer { ... }`` (or V1 ``layers { ... }``) blocks, which follow the order of the parsed
list. Nets often repeat a name under different phases (a TRAIN and a TEST 'data'
layer): the net's state picks the definition the net was built from.
"""
import contextlib
import re

from .. import caffe_pb2
from ..errors import CaffeError
from .graph import layer_included
from .prototxt import read_prototxt

#: comments, strings, the brackets of a message, the colon, other words, line ends
_TOKENS = re.compile(r'#[^\n]*|"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|[{}<>:\n]|[^\s{}<>:#"\']+')


def _block_lines(text, field):
    """The line of each top-level ``field { ... }`` block of prototxt ``text``, in order."""
    lines, depth, line, previous = [], 0, 1, None
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token == '\n':
            line += 1
        elif token in ('{', '<'):
            if depth == 0 and previous is not None and previous[0] == field:
                lines.append(previous[1])
            depth += 1
        elif token in ('}', '>'):
            depth -= 1
        elif token != ':' and not token.startswith('#'):
            previous = (token, line)
    return lines


def layer_line(path, layer_name, state=None):
    """The line on which the definition of layer ``layer_name`` starts in the prototxt at
    ``path``: of the layers so named, the one ``state`` (a NetState) includes. None where
    that is not one layer, or the file cannot tell."""
    try:
        param = read_prototxt(path, caffe_pb2.NetParameter())
        with open(path, encoding='utf-8', errors='replace') as f:
            text = f.read()
    except (CaffeError, OSError):
        return None
    field = 'layers' if len(param.layers) else 'layer'
    layers = list(getattr(param, field))
    lines = _block_lines(text, field)
    if len(lines) != len(layers):        # a syntax the scan does not know: say nothing
        return None
    named = [i for i, layer in enumerate(layers) if layer.name == layer_name]
    if len(named) > 1 and state is not None:
        named = [i for i in named if _included(layers[i], state)]
    return lines[named[0]] if len(named) == 1 else None


def _included(layer, state):
    try:
        return layer_included(layer, state)
    except CaffeError:                   # both include and exclude: the net said so first
        return True


@contextlib.contextmanager
def naming_net_file(path, net_param=None):
    """CaffeErrors raised inside name the net file ``path`` (unless they already do) and,
    where they come from a layer, the line its definition starts on; ``net_param`` is the
    net being built, whose state picks one of several layers of that name."""
    try:
        yield
    except CaffeError as exc:
        if str(path) in str(exc):
            raise
        state = net_param.state if net_param is not None else None
        line = layer_line(path, exc.layer, state) if exc.layer is not None else None
        error = CaffeError('%s%s: %s' % (path, ':%d' % line if line else '', exc))
        error.layer = exc.layer
        raise error from None
