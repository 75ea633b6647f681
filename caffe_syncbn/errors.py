"""Errors a user can act on: they name the file, the layer and the shapes involved.

Every message is one line. The readers of files keep theirs to at most ``MAX_MESSAGE``
characters, quoting at most ``MAX_QUOTE`` characters of the input itself (``quote``), so
that a corrupt file cannot fill a terminal; the fuzz tests hold them to it.
"""
import contextlib
import re

MAX_MESSAGE = 300
MAX_QUOTE = 80


class CaffeError(Exception):
    """A problem with the user's net, weights or data (not a bug in this package)."""

    #: the name of the layer the message names (set by ``layer_error``)
    layer = None

    def __init__(self, message=''):
        message = str(message)
        super().__init__(' '.join(message.split()) if '\n' in message else message)


def layer_error(param, message):
    """A CaffeError that names the layer (name and type) it came from."""
    error = CaffeError("layer '%s' (type %s): %s" % (quote(param.name, quotes=False),
                                                      quote(param.type, quotes=False), message))
    error.layer = param.name
    return error


@contextlib.contextmanager
def naming(path):
    """CaffeErrors raised inside name the file ``path`` (unless they already do)."""
    try:
        yield
    except CaffeError as exc:
        if str(path) in str(exc):
            raise
        error = CaffeError('%s: %s' % (path, exc))
        error.layer = exc.layer
        raise error from None


def quote(value, limit=MAX_QUOTE, quotes=True):
    """``value`` (text or bytes from the input) as printable text of at most ``limit``
    characters, quoted unless ``quotes`` is False: control characters and bytes that are
    not UTF-8 are escaped, and a longer value keeps its start and end (where a path has
    its name), saying how long it was."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        text = bytes(value).decode('utf-8', 'backslashreplace')
    else:
        text = str(value).encode('utf-8', 'surrogateescape').decode('utf-8', 'backslashreplace')
    length = len(text)
    text = _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)
    if len(text) > limit:
        suffix = ' (%d characters)' % length
        keep = max(limit - len(suffix) - 3, 8)
        text = '%s...%s%s' % (text[:keep - keep // 3], text[len(text) - keep // 3:], suffix)
    return "'%s'" % text if quotes else text


def name_list(names, limit=100):
    """'a', 'b', 'c' and 12 more: as many quoted names as fit in ``limit`` characters."""
    shown = []
    for name in names:
        text = quote(name, 40)
        if shown and sum(len(t) + 2 for t in shown) + len(text) > limit:
            break
        shown.append(text)
    more = len(names) - len(shown)
    return ', '.join(shown) + (' and %d more' % more if more else '') if names else 'none'


_UNPRINTABLE = re.compile(r'[\x00-\x1f\x7f-\x9f]')
