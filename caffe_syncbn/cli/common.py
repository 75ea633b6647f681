"""What the command-line tools share: one clear error line instead of a traceback, and a
progress bar that log lines do not break."""
import contextlib
import logging
import sys
import traceback

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..errors import CaffeError


@contextlib.contextmanager
def progress_bar(total, initial=0):
    """A tqdm bar on the terminal, stderr or else stdout (None when neither is one). While
    it shows on stderr, the log's stderr lines go through tqdm.write, which lifts the bar,
    writes the line and draws the bar again below it: a line never runs into the bar."""
    stream = next((s for s in (sys.stderr, sys.stdout) if _is_terminal(s)), None)
    if stream is None:
        yield None
        return
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

