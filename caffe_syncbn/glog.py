"""Logging in glog's format, so that Caffe's log tools read our logs."""
import contextlib
import datetime
import logging
import os
import sys
import threading

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


class LogFileHandler(logging.FileHandler):
    """A log file that may fail to take a line (a full disk, a file size limit). The first
    failure is one warning on the logger's other handlers (stderr), and the file is then
    dropped: logging's own handler would print a traceback for every line, while stderr
    still has the whole log."""

    failed = False

    def emit(self, record):
        if not self.failed:       # a thread already past the logger's list of handlers
            super().emit(record)

    def handleError(self, record):
        if self.failed:
            return
        self.failed = True
        exc = sys.exc_info()[1]
        logger = logging.getLogger('caffe_syncbn')
        logger.removeHandler(self)             # first, so that the warning does not come here
        with contextlib.suppress(OSError):     # closing flushes the lines that did not fit
            self.close()
        logger.warning('cannot write the log file %s: %s; the log goes on on stderr only',
                       self.baseFilename, getattr(exc, 'strerror', None) or exc)


def setup_logging(log_file=None, level=None):
    """glog-format lines on stderr (and appended to ``log_file``). The level defaults to
    INFO, or to what GLOG_minloglevel says, as for Caffe. Where ``log_file`` cannot take
    a line, one warning says so and the log goes on on stderr (LogFileHandler)."""
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
            handlers.append(LogFileHandler(log_file, mode='a'))
        except OSError as exc:
            raise CaffeError('-log_file %s: %s' % (log_file, exc.strerror or exc)) from None
    for handler in handlers:
        handler.setFormatter(GlogFormatter())
        logger.addHandler(handler)
    logger.propagate = False
    return logger


def log_to_stderr_unless_configured():
    """What glog does before InitGoogleLogging, and so what pycaffe's solvers print without
    ``init_log()``: INFO and up (or what GLOG_minloglevel says) on stderr in glog's format.
    Only where nothing chose otherwise: neither this package's logger nor the root logger
    has a handler (``init_log``, ``logging.basicConfig``, a test runner's capture)."""
    if logging.getLogger('caffe_syncbn').handlers or logging.getLogger().handlers:
        return
    setup_logging()


def _int_env(name):
    try:
        return int(os.environ.get(name, 0))
    except ValueError:
        return 0
