"""Reading prototxt files, with errors that name the file, the line and the column.

Caffe reads a prototxt as bytes, so comments in any encoding (Latin-1, GBK, ...) are
fine there, and they are fine here. Outside comments the text must be UTF-8, since
names and paths become Python strings; a byte that is not is reported with its line.
"""
import re

from google.protobuf import text_format

from ..errors import MAX_QUOTE, CaffeError, quote
from ..forks import fork_of_param_field, fork_of_repeated_setting, fork_of_setting
from ..formats.regular import require_regular

_UTF8_BOM = b'\xef\xbb\xbf'
_LONG_TOKEN = re.compile(r'[^\s\'"]{%d,}' % (MAX_QUOTE + 1))
_UNKNOWN_FIELD = re.compile(r'has no field named "(\w+)"')
_UNKNOWN_SETTING = re.compile(r'(?:Message|Enum) type "caffe\.([\w.]+)" has no '
                              r'(?:field|value) named "?(\w+)"?')
_REPEATED_SETTING = re.compile(r'Message type "caffe\.([\w.]+)" should not have multiple '
                               r'"(\w+)" fields')
#: a template's placeholder, which a fork's run script replaces before Caffe reads the file
#: (DeepLab's configs hold ${NUM_LABELS}, ${EXP}, ... that its run_pascal.sh fills with sed)
_PLACEHOLDER = re.compile(r'\$\{(\w+)\}')


def parse_text(text, message, filename='<string>'):
    """Parse prototxt ``text`` into ``message``; a syntax error names file:line:column."""
    try:
        return text_format.Parse(text, message)
    except text_format.ParseError as exc:
        line, column = exc.GetLine(), exc.GetColumn()
        raise CaffeError('%s:%s:%s: cannot parse %s: %s%s'
                         % (filename, line, column, message.DESCRIPTOR.name,
                            _reason(exc, text, line),
                            _fork_hint(exc) or _template_hint(text, line))) from None


def _fork_hint(exc):
    """Where an unknown field comes from, when it is a known fork's setting."""
    for pattern, fork_of in ((_UNKNOWN_SETTING, fork_of_setting),
                             (_REPEATED_SETTING, fork_of_repeated_setting)):
        setting = pattern.search(str(exc))
        fork = fork_of(*setting.groups()) if setting else None
        if fork:
            return ' (a setting of %s; %s)' % fork
    unknown = _UNKNOWN_FIELD.search(str(exc))
    fork = fork_of_param_field(unknown.group(1)) if unknown else None
    return ' (a layer setting of %s, not implemented)' % fork if fork else ''


def _template_hint(text, line):
    """What to do when the line the parser stopped on holds a template's placeholder."""
    lines = text.splitlines() if isinstance(text, str) else []
    found = _PLACEHOLDER.search(lines[line - 1]) if line and 0 < line <= len(lines) else None
    if not found:
        return ''
    return (' (${%s} is a placeholder of a template, which its run script fills before Caffe '
            'reads it: fill it first)' % found.group(1))


def _reason(exc, text, line):
    """The parser's complaint without its location, its copy of the whole line, or any
    long token (a corrupt file may hold a line of megabytes)."""
    reason = str(exc)
    prefix = '%s:%s : ' % (line, exc.GetColumn())
    if reason.startswith(prefix):
        reason = reason[len(prefix):]
    lines = text.splitlines() if isinstance(text, str) else []
    if line and 0 < line <= len(lines):
        echoed = "'%s': " % lines[line - 1]
        if reason.startswith(echoed):
            reason = reason[len(echoed):]
    reason = _LONG_TOKEN.sub(lambda m: quote(m.group(), quotes=False), reason)
    return reason if len(reason) <= 160 else reason[:157] + '...'


def decode_prototxt(raw, filename):
    """The text of a prototxt file's bytes: UTF-8 (with or without a byte-order mark), with
    comments in any encoding. A non-UTF-8 byte outside a comment is a CaffeError."""
    if raw.startswith(_UTF8_BOM):
        raw = raw[len(_UTF8_BOM):]
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError:
        pass
    lines = []
    for number, line in enumerate(raw.split(b'\n'), 1):
        try:
            lines.append(line.decode('utf-8'))
            continue
        except UnicodeDecodeError as exc:
            bad = exc.start
        comment = _comment_start(line)
        if comment is None or bad < comment:
            column = len(line[:bad].decode('utf-8', 'replace')) + 1
            hint = ' (the file looks like UTF-16: save it as UTF-8)' \
                if raw[:2] in (b'\xff\xfe', b'\xfe\xff') else ''
            raise CaffeError('%s:%d:%d: byte 0x%02x is not UTF-8: outside comments a prototxt '
                             'must be UTF-8 text%s' % (filename, number, column, line[bad], hint))
        lines.append(line[:comment].decode('utf-8') + '#')     # the comment is not needed
    return '\n'.join(lines)


def _comment_start(line):
    """The index of the '#' that starts a comment in a line of bytes, or None (a '#'
    inside a quoted string starts none)."""
    quote_char, escaped = None, False
    for i, byte in enumerate(line):
        if quote_char is not None:
            if escaped:
                escaped = False
            elif byte == 0x5c:                              # backslash
                escaped = True
            elif byte == quote_char:
                quote_char = None
        elif byte in (0x22, 0x27):                          # " or '
            quote_char = byte
        elif byte == 0x23:                                  # #
            return i
    return None


def read_prototxt(path, message):
    """Parse the prototxt file at ``path`` into ``message`` (a fresh protobuf message)."""
    require_regular(path)
    try:
        with open(path, 'rb') as f:
            raw = f.read()
    except OSError as exc:
        raise CaffeError('cannot read %s: %s' % (quote(path), exc.strerror or exc)) from None
    return parse_text(decode_prototxt(raw, str(path)), message, str(path))
