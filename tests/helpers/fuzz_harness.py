"""The parent side of the fuzz suite: a worker process that runs readers on bad files,
byte mutations of real files, and the check that every outcome is an allowed one.

A ``Worker`` keeps one child (tests/helpers/fuzz_readers.py) alive across cases, so a case costs
what its reader costs, not a Python start. A child killed by a signal, or one that hangs
on a case (stalls or spins, as tests/helpers/watchdog.py tells a hang from a slow machine: a case
may take ``limit`` seconds of an idle machine), is recorded against the case it was
running and replaced.

Outcome classes: ``accepted`` (the reader took the file), ``CaffeError`` (one clear line),
and the failures ``leak:<exception type>``, ``signal:<name>``, ``hang``, ``exit:<code>``.
"""
import collections
import contextlib
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile
import numpy as np
from helpers.watchdog import STALL, Hang, Watch, tree_cpu

from caffe_syncbn.errors import MAX_MESSAGE, MAX_QUOTE
from helpers.paths import ROOT

MEMORY_LIMIT = 3 << 30
#: seconds a case may take on an idle machine, the child's start included
LIMIT = 20.0
#: 0 in CI (fixed seeds); set FUZZ_SEED=n to draw other cases, to look further
SEED = int(os.environ.get('FUZZ_SEED', '0'))


@contextlib.contextmanager
def short_folder():
    """A temporary folder with a path as short as a user's: messages name files whole
    (and must fit in 300 characters), where pytest's own paths run to 90 characters."""
    with tempfile.TemporaryDirectory(prefix='fz') as name:
        yield pathlib.Path(name)


class Worker:
    def __init__(self, memory_limit=MEMORY_LIMIT, limit=LIMIT, stall=STALL):
        self.memory_limit, self.limit, self.stall = memory_limit, limit, stall
        self.proc = None
        self.stderr = tempfile.TemporaryFile()

    def _start(self):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS='1',
                   OPENBLAS_NUM_THREADS='1', MKL_NUM_THREADS='1', PYTHONHASHSEED='0')
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / 'tests' / 'helpers' / 'fuzz_readers.py'),
             str(self.memory_limit)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, cwd=str(ROOT),
            env=env)
        self._pending = b''

    def run(self, reader, args, cwd=None):
        """The answer of the child (see fuzz_readers.py) for one case, or a failure."""
        if self.proc is None:
            self._start()
        start_err = self.stderr.seek(0, os.SEEK_END)
        request = json.dumps({'reader': reader, 'args': args, 'cwd': cwd and str(cwd)})
        try:
            self.proc.stdin.write(request.encode() + b'\n')
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        answer = self._answer()
        self.stderr.seek(start_err)
        answer['stderr'] = self.stderr.read(4000).decode('utf-8', 'replace')
        return answer

    def _answer(self):
        pid = self.proc.pid
        watch = Watch('the reader', self.limit, lambda: tree_cpu(pid), self.stall)
        fd = self.proc.stdout.fileno()
        while b'\n' not in self._pending:
            if not select.select([fd], [], [], 1.0)[0]:
                try:
                    watch.check()
                except Hang as exc:
                    self.close()
                    return {'outcome': 'hang', 'message': str(exc)}
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                code = self.proc.wait()
                self.proc = None
                if code < 0:
                    return {'outcome': 'signal:%s' % signal.Signals(-code).name, 'message': ''}
                return {'outcome': 'exit:%d' % code, 'message': ''}
            self._pending += chunk
        line, self._pending = self._pending.split(b'\n', 1)
        return json.loads(line)

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class Tally:
    """Outcomes of one reader's cases: the count per class, and the failures."""

    def __init__(self, name):
        self.name = name
        self.counts = collections.Counter()
        self.failures = []

    def add(self, case, answer, names=(), must_report=False):
        """Record ``answer`` for ``case``. A CaffeError must be one line of <= 300 characters that
        quotes no more than MAX_QUOTE characters of input and contains each of ``names``
        (the file, ...); with ``must_report`` (weights lost) acceptance needs a warning."""
        outcome = answer['outcome']
        if outcome == 'leak':
            outcome = 'leak:%s' % answer['type']
        problem = None
        if outcome.startswith(('leak', 'signal', 'hang', 'exit')):
            problem = answer.get('traceback') or answer.get('message')
        elif outcome == 'CaffeError':
            message = answer['message']
            missing = [n for n in names if n not in message]
            if len(message) > MAX_MESSAGE or '\n' in message:
                problem = 'message of %d characters: %r' % (len(message), message)
            elif missing:
                problem = 'message does not name %s: %r' % (missing, message)
            elif _longest_token(message, names) > MAX_QUOTE + 3:    # quotes, a comma
                problem = 'message quotes more than %d characters: %r' % (MAX_QUOTE, message)
        elif must_report and not answer['warnings']:
            outcome = 'silent weight loss'
            problem = 'accepted without a warning'
        elif must_report:
            outcome = 'accepted with a warning'
        if 'HDF5-DIAG' in answer.get('stderr', ''):
            problem = problem or 'libhdf5 printed its error stack: %s' % answer['stderr'][:300]
        self.counts[outcome] += 1
        if problem:
            self.failures.append('%s: %s: %s' % (case, outcome, str(problem)[-1500:]))

    def summary(self):
        return '%s: %d cases: %s' % (self.name, sum(self.counts.values()),
                                     ', '.join('%s %d' % kv for kv in sorted(self.counts.items())))

    def check(self):
        print(self.summary())
        worst = sorted(self.failures, key=lambda f: ': CaffeError: ' in f or ': accepted' in f)
        assert not self.failures, '%d failure(s) in %s, first ones:\n%s' % (
            len(self.failures), self.summary(), '\n'.join(worst[:8]))


def _longest_token(message, names):
    """The longest word of ``message`` once the file names in it are taken out."""
    for name in names:
        message = message.replace(name, ' ')
    return max((len(t) for t in message.split()), default=0)


# ---- byte mutations -----------------------------------------------------------------------
def bit_flips(data, rs, count=None):
    data = bytearray(data)
    for _ in range(count or rs.randint(1, 5)):
        k = rs.randint(len(data) * 8)
        data[k // 8] ^= 1 << (k % 8)
    return bytes(data)


def overwrite(data, rs):
    start = rs.randint(len(data))
    length = min(rs.randint(1, 64), len(data) - start)
    return data[:start] + rs.randint(0, 256, length).astype(np.uint8).tobytes() + \
        data[start + length:]


def truncate(data, rs):
    return data[:rs.randint(len(data))]


def splice(data, rs):
    """A span deleted, or random bytes inserted."""
    start = rs.randint(len(data))
    if rs.randint(2):
        return data[:start] + data[start + rs.randint(1, 64):]
    return data[:start] + rs.randint(0, 256, rs.randint(1, 64)).astype(np.uint8).tobytes() + \
        data[start:]


def mutants(data, seed, count, extra=()):
    """``count`` mutants of ``data``: (name, bytes), drawn with RandomState(seed)."""
    rs = np.random.RandomState(seed + 100003 * SEED)
    kinds = [bit_flips, overwrite, truncate, splice] + list(extra)
    for i in range(count):
        kind = kinds[i % len(kinds)]
        yield '%s_%d' % (kind.__name__, i), kind(data, rs)


# ---- protobuf wire format -----------------------------------------------------------------
def read_varint(data, pos):
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError('bad varint')
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        shift += 7
        if not byte & 0x80:
            return value, pos


def varint(value):
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def wire_fields(data, start=0, end=None):
    """(field number, tag offset, length offset, payload start, payload end) of the fields
    of a message in data[start:end]; None if it is not one."""
    end = len(data) if end is None else end
    fields, pos = [], start
    try:
        while pos < end:
            tag_at = pos
            tag, pos = read_varint(data, pos)
            wire_type = tag & 7
            if wire_type == 0:
                _, pos = read_varint(data, pos)
                fields.append((tag >> 3, tag_at, None, None, pos))
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
                fields.append((tag >> 3, tag_at, None, None, pos))
            elif wire_type == 2:
                length_at = pos
                length, pos = read_varint(data, pos)
                fields.append((tag >> 3, tag_at, length_at, pos, pos + length))
                pos += length
            else:
                return None
    except ValueError:
        return None
    return fields if pos == end else None


def length_fields(data, depth=3, start=0, end=None):
    """Every length-delimited field of a message and of the messages nested in it:
    (length offset, payload start)."""
    found = []
    for _, _, length_at, payload, payload_end in wire_fields(data, start, end) or []:
        if length_at is None:
            continue
        found.append((length_at, payload))
        if depth and payload_end > payload:
            found += length_fields(data, depth - 1, payload, payload_end)
    return found


HUGE_LENGTHS = (2 ** 31 - 1, 2 ** 31, 2 ** 32 + 7, 2 ** 62, 2 ** 64 - 1)


def huge_length(data, rs):
    """One length-delimited field (maybe nested) given a huge or off-by-one length."""
    fields = length_fields(data)
    if not fields:
        return bit_flips(data, rs)
    length_at, payload = fields[rs.randint(len(fields))]
    old, _ = read_varint(data, length_at)
    choices = list(HUGE_LENGTHS) + [old + 1, max(old - 1, 0)]
    return data[:length_at] + varint(choices[rs.randint(len(choices))]) + data[payload:]


def top_level_cuts(data):
    """data cut after each top-level field but the last: (number of fields kept, bytes)."""
    fields = wire_fields(data) or []
    return [(k, data[:fields[k - 1][4]]) for k in range(1, len(fields))]
