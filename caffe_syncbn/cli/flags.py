"""Command-line flags as Caffe spells them, in every form gflags reads.

gflags takes ``-f v``, ``-f=v``, ``--f v`` and ``--f=v``, and a boolean flag as ``-f``,
``-f=true`` or ``-nof``. ``normalize`` rewrites all of these, and this package's older
spellings (``--gpus``, ``--cpu-devices``, ``--sync-bn``: a dash in a name reads as an
underscore), into the one form an argparse parser reads, so each command is a plain
argparse parser. A flag that does not exist is an error that names it and the closest
flags of the command, spelled as the command spells them.
"""
import argparse
import difflib
import re

from ..errors import CaffeError

#: old names of this package's tools -> the flag they are now
ALIASES = {'gpus': 'gpu'}
_HELP = {'h', 'help', 'helpshort', 'helpfull'}
_TRUE = {'true', 't', 'yes', 'y', '1'}
_FALSE = {'false', 'f', 'no', 'n', '0'}


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one CaffeError line, and whose ``parse`` takes
    every gflags spelling. Flags are declared with ``flag('name', ...)`` as ``-name``."""

    def __init__(self, prog, description):
        super().__init__(prog=prog, description=description, allow_abbrev=False)

    def flag(self, name, **kwargs):
        return self.add_argument('-' + name, dest=name, **kwargs)

    def parse(self, argv):
        return self.parse_args(normalize(argv, self))

    def error(self, message):
        message = re.sub(r'argument (-\w+)(/\S+)?:', r'\1:', message)
        raise CaffeError('%s: %s (see %s -help)' % (self.prog, message, self.prog))


def normalize(argv, parser):
    """``argv`` with every flag in the spelling ``parser`` declares (see the module doc)."""
    spellings = _spellings(parser)
    out, switches = [], {}
    tokens = list(argv)
    while tokens:
        token = tokens.pop(0)
        if token == '--':
            out += ['--'] + tokens
            break
        if not _is_flag(token):
            out.append(token)
            continue
        name, has_value, value = token.lstrip('-').partition('=')
        key = name.replace('-', '_')
        if key in _HELP:
            out.append('-h')
            continue
        key = ALIASES.get(key, key)
        negated = key not in spellings and key.startswith('no') and key[2:] in spellings
        action = spellings.get(key[2:] if negated else key)
        if action is None:
            raise CaffeError(_unknown(token, parser, spellings))
        spelling = action.option_strings[0]
        if action.nargs == 0:                      # a switch: gflags' boolean flag
            if has_value and negated:
                raise CaffeError('%s: give -%s or -%s=false, not both' % (token, key[2:], key[2:]))
            switches[action.dest] = (spelling, not negated and _boolean(token, value, has_value))
        elif negated:
            raise CaffeError('%s: only a true/false flag takes the "no" prefix; %s takes a value'
                             % (token, spelling))
        elif has_value:
            out.append('%s=%s' % (spelling, value))
        elif tokens:
            out.append('%s=%s' % (spelling, tokens.pop(0)))   # the value may begin with '-'
        else:
            raise CaffeError('%s: %s needs a value' % (parser.prog, spelling))
    # a switch counts as gflags counts it: the last spelling given wins
    return [spelling for spelling, on in switches.values() if on] + out


def _is_flag(token):
    return token.startswith('-') and token != '-' and not re.match(r'-\.?\d', token)


def _spellings(parser):
    """{name with underscores: action} for every flag of ``parser``."""
    table = {}
    for action in parser._actions:
        for option in action.option_strings:
            table[option.lstrip('-').replace('-', '_')] = action
    return {k: v for k, v in table.items() if k not in _HELP}


def _boolean(token, value, has_value):
    if not has_value or value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise CaffeError('%s: expected true or false after "="' % token)


def _unknown(token, parser, spellings):
    name = token.lstrip('-').partition('=')[0].replace('-', '_')
    known = sorted({a.option_strings[0] for a in spellings.values()})
    close = difflib.get_close_matches(name, list(spellings), n=1, cutoff=0.6)
    hint = ('did you mean %s?' % spellings[close[0]].option_strings[0] if close
            else 'its flags are %s' % ' '.join(known))
    return '%s: unknown flag %s; %s' % (parser.prog, token.partition('=')[0], hint)


# ---- values ------------------------------------------------------------------------------
def positive_int(what):
    """An argparse type: a whole number >= 1, or an error that says what it counts."""
    def parse(text):
        if not re.fullmatch(r'\s*\+?\d+\s*', text) or int(text) < 1:
            raise argparse.ArgumentTypeError('expected a number of %s >= 1, got %r' % (what, text))
        return int(text)
    return parse


def non_negative_int(text):
    """An argparse type: a whole number >= 0."""
    if not re.fullmatch(r'\s*\+?\d+\s*', text):
        raise argparse.ArgumentTypeError('expected a whole number >= 0, got %r' % text)
    return int(text)


def gpu_ids(text):
    """-gpu: 'all', or device ids separated by ',' (an id may repeat: replicas on one GPU)."""
    if text.strip() == 'all':
        return 'all'
    ids = text.split(',')
    if not all(re.fullmatch(r'\s*\d+\s*', i) for i in ids):
        raise argparse.ArgumentTypeError("expected GPU ids such as 0 or 0,1,2,3, or 'all'; got %r"
                                         % text)
    return [int(i) for i in ids]


def stage_list(text):
    """-stage: NetState stages separated by ',' (the flag may also repeat)."""
    return [s for s in text.split(',') if s]
