"""What the command-line tools share: one clear error line instead of a traceback,
logging in glog's format, a progress bar that log lines do not break, and nets built
for timing."""
import contextlib
import datetime
import logging
import os
import sys
import threading
import traceback

from .errors import CaffeError

#: glog's severity letters; DEBUG has none in glog and reads as INFO there
_SEVERITY = {logging.DEBUG: 'I', logging.INFO: 'I', logging.WARNING: 'W', logging.ERROR: 'E',
             logging.CRITICAL: 'F'}
#: GLOG_minloglevel, as glog reads it: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL
_MIN_LEVELS = [logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL]


class GlogFormatter(logging.Formatter):
    """glog's line, ``I1122 21:51:57.033123  4388 solver.py:218] message``: severity, month and
    day, local time to the microsecond, the OS thread id right-aligned in 5, the Python file
    and line that logged. Caffe's tools (parse_log.py, extract_seconds.py) read these
    fields; every line of a multi-line message gets the prefix, so that none trips them."""

    def __init__(self):
        super().__init__('%(message)s')

    def format(self, record):
        when = datetime.datetime.fromtimestamp(record.created)
        prefix = '%s%s %5d %s:%d] ' % (_SEVERITY.get(record.levelno, 'I'),
                                        when.strftime('%m%d %H:%M:%S.%f'),
                                        threading.get_native_id(), record.filename, record.lineno)
        return '\n'.join(prefix + line for line in super().format(record).split('\n'))


def setup_logging(log_file=None, level=None):
    """glog-format lines on stderr (and appended to ``log_file``). The level defaults to
    INFO, or to what GLOG_minloglevel says, as for Caffe."""
    if level is None:
        level = _MIN_LEVELS[min(max(_int_env('GLOG_minloglevel'), 0), 3)]
    logger = logging.getLogger('caffe_syncbn')
    logger.setLevel(level)
    for handler in logger.handlers:
        handler.close()
    logger.handlers[:] = []
    handlers = [logging.StreamHandler(sys.stderr)]
    if log_file:
        try:
            handlers.append(logging.FileHandler(log_file, mode='a'))
        except OSError as exc:
            raise CaffeError('-log_file %s: %s' % (log_file, exc.strerror or exc)) from None
    for handler in handlers:
        handler.setFormatter(GlogFormatter())
        logger.addHandler(handler)
    logger.propagate = False
    return logger


def _int_env(name):
    try:
        return int(os.environ.get(name, 0))
    except ValueError:
        return 0


@contextlib.contextmanager
def progress_bar(total, initial=0):
    """A tqdm bar on the terminal, stderr or else stdout (None when neither is one). While
    it shows on stderr, the log's stderr lines go through tqdm.write, which lifts the bar,
    writes the line and draws the bar again below it: a line never runs into the bar."""
    stream = next((s for s in (sys.stderr, sys.stdout) if _is_terminal(s)), None)
    if stream is None:
        yield None
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm
    bar = tqdm(total=total, initial=initial, file=stream, unit='it', dynamic_ncols=True,
               leave=False)
    try:
        if stream is sys.stderr:
            with logging_redirect_tqdm([logging.getLogger('caffe_syncbn')], tqdm_class=tqdm):
                yield bar
        else:
            yield bar
    finally:
        bar.close()


def _is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):       # replaced or closed streams
        return False


def run_main(main):
    """Run a tool's main(); a CaffeError or a missing file is one line on stderr and exit 1.

    Every tool takes ``--debug`` (taken out of sys.argv before main() parses it): the error
    then comes with its traceback.
    """
    debug = '--debug' in sys.argv[1:]
    if debug:
        sys.argv[1:] = [arg for arg in sys.argv[1:] if arg != '--debug']
    try:
        sys.exit(main())
    except (CaffeError, FileNotFoundError) as exc:
        if debug:
            traceback.print_exc()
        print('error: %s' % exc, file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print('interrupted', file=sys.stderr)
        sys.exit(130)


def build_timing_net(model, batch=None, phase='TRAIN', level=0, stages=()):
    """A Net for timing (timing.timing_net_param: Input layers of batch ``batch``, backward
    forced), as the benchmarks time it."""
    from . import TEST, TRAIN, Net
    from .timing import timing_net_param
    return Net(timing_net_param(model, batch), TRAIN if phase == 'TRAIN' else TEST, level=level,
               stages=stages)
