"""What the command-line tools share: one clear error line instead of a traceback,
logging in Caffe's format, and nets built for timing."""
import logging
import sys

from .errors import CaffeError

LOG_FORMAT = '%(levelname).1s%(asctime)s.%(msecs)03d %(process)d %(module)s] %(message)s'


def setup_logging(log_file=None, level=logging.INFO):
    """Caffe/glog-style lines on stderr (and in ``log_file``), so log parsers keep working."""
    formatter = logging.Formatter(LOG_FORMAT, datefmt='%m%d %H:%M:%S')
    logger = logging.getLogger('caffe_syncbn')
    logger.setLevel(level)
    logger.handlers[:] = []
    handlers = [logging.StreamHandler(sys.stderr)]
    if log_file:
        handlers.append(logging.FileHandler(log_file, mode='a'))
    for handler in handlers:
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    logger.propagate = False
    return logger


def run_main(main):
    """Run a tool's main(); a CaffeError or a missing file is one line on stderr and exit 1."""
    try:
        sys.exit(main())
    except (CaffeError, FileNotFoundError) as exc:
        print('error: %s' % exc, file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print('interrupted', file=sys.stderr)
        sys.exit(130)


def build_timing_net(model, batch=None, phase='TRAIN'):
    """A Net for timing: data layers become Input layers (batch ``batch``), backward forced."""
    from . import TEST, TRAIN, Net
    from .net import load_net_param
    from .upgrade import swap_data_layers_for_inputs
    param = swap_data_layers_for_inputs(load_net_param(model), batch=batch)
    param.force_backward = True
    return Net(param, TRAIN if phase == 'TRAIN' else TEST)
