"""SolverParameter handling: reading and upgrading solver prototxts, checking their
settings, and the NetParameters (with their NetState) of the train and test nets."""
import collections
import logging
import os

from .. import caffe_pb2
from ..caffe_pb2 import TEST, TRAIN
from ..errors import CaffeError, quote
from .prototxt import read_prototxt
from .upgrade import load_net_param

log = logging.getLogger('caffe_syncbn')

#: the deprecated solver_type enum's values as SolverParameter.type names
_LEGACY_TYPES = {caffe_pb2.SolverParameter.SGD: 'SGD', caffe_pb2.SolverParameter.NESTEROV: 'Nesterov',
                 caffe_pb2.SolverParameter.ADAGRAD: 'AdaGrad', caffe_pb2.SolverParameter.RMSPROP: 'RMSProp',
                 caffe_pb2.SolverParameter.ADADELTA: 'AdaDelta', caffe_pb2.SolverParameter.ADAM: 'Adam'}

#: a net a solver names: its NetParameter, and the net file it was read from (None for a
#: net written inside the solver file), which errors in the net then name
SolverNet = collections.namedtuple('SolverNet', 'param file')


def load_solver_param(path):
    """Read a solver prototxt (a parse error names file:line:column) and upgrade it as Caffe does.

    ``net:`` and the other paths inside stay relative to the current working directory,
    as in Caffe. A missing ``snapshot_prefix`` becomes the solver path without its
    extension; a prefix that is a folder gets the solver file's stem appended.
    """
    path = os.fspath(path)
    param = read_prototxt(path, caffe_pb2.SolverParameter())
    upgrade_solver_param(param, path)
    if not param.HasField('snapshot_prefix'):
        param.snapshot_prefix = os.path.splitext(path)[0]
    elif os.path.isdir(param.snapshot_prefix):
        stem = os.path.splitext(os.path.basename(path))[0]
        param.snapshot_prefix = os.path.join(param.snapshot_prefix, stem)
    return param


def upgrade_solver_param(param, source='solver'):
    """Turn the deprecated ``solver_type`` enum into the ``type`` string. Which types there
    are is the training room's registry (training/rules.py), which checks the type."""
    if param.HasField('solver_type'):
        if param.HasField('type'):
            raise CaffeError('%s: the deprecated solver_type and type are both set; keep only type'
                             % source)
        param.type = _LEGACY_TYPES[param.solver_type]
        param.ClearField('solver_type')
    return param


def copy_message(message):
    fresh = type(message)()
    fresh.CopyFrom(message)
    return fresh


def _read_net(path, field, source):
    _require_net_file(path, field, source)
    return copy_message(load_net_param(path))


def _require_net_file(path, field, source):
    if not os.path.exists(path):
        hint = ''
        if source != 'solver':
            beside = os.path.join(os.path.dirname(os.path.abspath(source)), path)
            if os.path.isfile(beside):
                hint = '; it exists next to the solver file: run from %s' % os.path.dirname(beside)
        raise CaffeError("%s: %s file %s not found (paths in a solver are relative to the "
                         'current directory, %s)%s'
                         % (source, field, quote(path), os.getcwd(), hint))


def _with_state(net_param, phase, state):
    """Caffe's precedence: the phase, then the net's own state, then the solver's."""
    merged = caffe_pb2.NetState(phase=phase)
    merged.MergeFrom(net_param.state)
    if state is not None:
        merged.MergeFrom(state)
    net_param.state.CopyFrom(merged)
    return net_param


def check_net_files(p, source):
    """The error of the first net file the solver names that is not there. Called before
    the other paths are checked: run from the wrong folder, every relative path of the
    solver misses, and the net file is the one whose message says where to run from."""
    for field in ('net', 'train_net'):
        if p.HasField(field):
            _require_net_file(getattr(p, field), field, source)
    for path in p.test_net:
        _require_net_file(path, 'test_net', source)


def train_net_param(p, source):
    """The train net (a SolverNet), its state merged from TRAIN and ``train_state``."""
    fields = [f for f in ('net', 'net_param', 'train_net', 'train_net_param') if p.HasField(f)]
    if len(fields) != 1:
        raise CaffeError('%s: give the train net in exactly one of net, net_param, train_net, '
                         'train_net_param (found %s)' % (source, ', '.join(fields) or 'none'))
    field = fields[0]
    if field in ('net', 'train_net'):
        path = getattr(p, field)
        log.info('Creating training net from %s file: %s', field, path)
        return SolverNet(_with_state(_read_net(path, field, source), TRAIN, p.train_state), path)
    log.info('Creating training net specified in %s.', field)
    return SolverNet(_with_state(copy_message(getattr(p, field)), TRAIN, p.train_state), None)


def test_net_params(p, source):
    """The test nets (SolverNets): test_net_param, then test_net files, then as many copies
    of net/net_param as test_iter entries remain; states from TEST and test_state."""
    if p.HasField('net') and p.HasField('net_param'):
        raise CaffeError('%s: net and net_param may not both be given' % source)
    generic = p.HasField('net') or p.HasField('net_param')
    specific = len(p.test_net_param) + len(p.test_net)
    if (generic and len(p.test_iter) < specific) or (not generic and len(p.test_iter) != specific):
        raise CaffeError('%s: test_iter must be given once per test net (%d test_iter for %d '
                         'test nets)' % (source, len(p.test_iter), specific))
    count = max(len(p.test_iter), specific) if generic else specific
    if p.test_state and len(p.test_state) != count:
        raise CaffeError('%s: test_state must be given once per test net or not at all (%d for %d)'
                         % (source, len(p.test_state), count))
    if count and p.test_interval <= 0:
        raise CaffeError('%s: %d test net(s) but test_interval is %d; set test_interval > 0'
                         % (source, count, p.test_interval))
    readers = [('test_net_param', None, lambda m=m: copy_message(m)) for m in p.test_net_param]
    readers += [('test_net file: ' + f, f, lambda f=f: _read_net(f, 'test_net', source))
                for f in p.test_net]
    for _ in range(count - specific):
        if p.HasField('net_param'):
            readers.append(('net_param', None, lambda: copy_message(p.net_param)))
        else:
            readers.append(('net file: ' + p.net, p.net, lambda: _read_net(p.net, 'net', source)))
    nets = []
    for i, (where, path, read) in enumerate(readers):
        log.info('Creating test net (#%d) specified by %s', i, where)
        state = p.test_state[i] if p.test_state else None
        nets.append(SolverNet(_with_state(read(), TEST, state), path))
    return nets
