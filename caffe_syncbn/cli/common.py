"""What the command-line tools share: one clear error line instead of a traceback,
logging in glog's format, a progress bar that log lines do not break, and nets built
for timing."""
import contextlib
import logging
import sys
import traceback

from .. import TEST, TRAIN, Net
from ..errors import CaffeError
from ..memory_planner import DEFAULT_PLAN
from .timing import timing_net_param


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


def build_timing_net(model, batch=None, phase='TRAIN', level=0, stages=(),
                     memory_plan=DEFAULT_PLAN['pycaffe'], input_shape=None):
    """A Net for timing (timing.timing_net_param: Input layers of batch ``batch``, shaped
    by their sources or ``input_shape``, backward forced), as the benchmarks time it."""
    phase = TRAIN if phase == 'TRAIN' else TEST
    return Net(timing_net_param(model, batch, phase=phase, level=level, stages=stages,
                                input_shape=input_shape),
               phase, level=level, stages=stages, memory_plan=memory_plan)
