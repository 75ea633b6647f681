"""Reading prototxt files, with errors that name the file, the line and the column."""
from google.protobuf import text_format

from .errors import CaffeError


def parse_text(text, message, filename='<string>'):
    """Parse prototxt ``text`` into ``message``; a syntax error names file:line:column."""
    try:
        return text_format.Parse(text, message)
    except text_format.ParseError as exc:
        line, column = exc.GetLine(), exc.GetColumn()
        reason = str(exc)
        prefix = '%s:%s' % (line, column)
        if reason.startswith(prefix):
            reason = reason[len(prefix):].lstrip(' :')
        raise CaffeError('%s:%s:%s: cannot parse %s: %s'
                         % (filename, line, column, message.DESCRIPTOR.name, reason)) from None


def read_prototxt(path, message):
    """Parse the prototxt file at ``path`` into ``message`` (a fresh protobuf message)."""
    try:
        with open(path, encoding='utf-8') as f:
            text = f.read()
    except OSError as exc:
        raise CaffeError('cannot read %s: %s' % (path, exc.strerror)) from None
    return parse_text(text, message, str(path))
