"""The ``caffe-syncbn`` command: Caffe's ``caffe`` tool, with its subcommands and flags.

    caffe-syncbn train -solver solver.prototxt [-gpu 0,1 | -cpu_devices 4] [-sync_bn]
    caffe-syncbn test -model train_val.prototxt -weights net.caffemodel [-iterations 50]
    caffe-syncbn time -model net.prototxt [-iterations 50]
    caffe-syncbn device_query [-gpu all]
    caffe-syncbn convert to-syncbn|to-batchnorm|fold-bn|to-deploy|to-onnx -model ... -output ...
    caffe-syncbn draw net.prototxt net.png [-rankdir LR] [-phase TRAIN|TEST|ALL]
    caffe-syncbn upgrade old.prototxt|old.caffemodel|old_solver.prototxt new_file

Flags take every gflags spelling (see flags.py); tools/train_net.py, test_net.py and
time_net.py are this command's train, test and time.
"""
import functools
import logging
import os
import signal
import sys
import time

from .errors import CaffeError
from .flags import FlagParser, gpu_ids, normalize, positive_int, stage_list
from .tools_common import progress_bar, run_main, setup_logging

log = logging.getLogger('caffe_syncbn')

PROG = 'caffe-syncbn'
EFFECTS = ('stop', 'snapshot', 'none')
COMMANDS = {
    'train': 'train or finetune a model',
    'test': 'score a model',
    'device_query': 'show the devices (GPU diagnostic information with -gpu)',
    'time': 'benchmark model execution time',
    'convert': 'convert a model: to-syncbn, to-batchnorm, fold-bn, to-deploy, to-onnx',
    'draw': 'draw a net as a PNG, SVG or PDF diagram',
    'upgrade': 'upgrade a V1 or old-style net prototxt, caffemodel or solver prototxt',
}


# ---- flags ---------------------------------------------------------------------------------
def _parser(command):
    p = FlagParser('%s %s' % (PROG, command), COMMANDS[command])
    if command in ('train', 'test', 'time', 'device_query'):
        where = p.add_mutually_exclusive_group()
        where.add_argument('-gpu', dest='gpu', type=gpu_ids, metavar='IDS',
                           help="GPU ids separated by ',' or 'all' (an id may repeat: 0,0 runs "
                                'two replicas on GPU 0)' if command == 'train' else
                                'run on this GPU')
        if command == 'train':
            where.add_argument('-cpu_devices', dest='cpu_devices', metavar='N',
                               type=positive_int('devices'),
                               help='virtual CPU devices (threads); 1 when no GPU is asked for')
        else:
            where.add_argument('-cpu', dest='cpu', action='store_true', help='run on the CPU '
                               '(the default)')
    if command == 'train':
        p.flag('solver', required=True, metavar='FILE', help='the solver definition protocol buffer text file')
        p.flag('weights', metavar='FILES', help="caffemodel(s) to finetune from, separated by ','; they replace "
                               "the solver's weights")
        p.flag('snapshot', metavar='FILE', help='the solver state to resume training from')
        p.flag('sync_bn', action='store_true', help='turn every BatchNorm(+Scale) and BN layer '
                                                    'into SyncBN')
        for name, default in (('sigint_effect', 'stop'), ('sighup_effect', 'snapshot')):
            p.flag(name, choices=EFFECTS, default=default, help='what a %s does (default %s)'
                   % (name.split('_')[0].upper(), default))
        p.flag('nan_effect', choices=EFFECTS, default='none',
               help='what the first non-finite loss or gradient does besides a warning '
                    '(default none: training goes on, as in Caffe)')
        p.flag('log_file', metavar='FILE', help='also append the log to this file')
    if command in ('test', 'time'):
        p.flag('model', required=True, metavar='FILE', help='the model definition protocol buffer text file')
        p.flag('iterations', type=positive_int('iterations'), default=50, metavar='N',
               help='the number of iterations to run (default 50)')
        p.flag('phase', choices=('TRAIN', 'TEST'), default='TEST' if command == 'test' else 'TRAIN',
               help='the network phase (default %s)' % ('TEST' if command == 'test' else 'TRAIN'))
    if command == 'test':
        p.flag('weights', required=True, metavar='FILES', help="the caffemodel(s) to score, separated by ','")
    if command == 'time':
        p.flag('batch', type=positive_int('rows'), metavar='N', help="the batch size (default: the prototxt's)")
    if command in ('train', 'test', 'time'):
        p.flag('level', type=int, metavar='N', help='the network level (NetState)')
        p.flag('stage', type=stage_list, action='append', default=[], metavar='S',
               help="network stages separated by ',' (the flag may repeat)")
    if command == 'draw':
        p.add_argument('model', help='the net prototxt')
        p.add_argument('output', help='the image to write; its extension (png, svg, pdf) says '
                                      'the format')
        p.flag('rankdir', default='LR', choices=('LR', 'RL', 'TB', 'BT'),
               help='the direction of the graph (default LR: left to right)')
        p.flag('phase', choices=('TRAIN', 'TEST', 'ALL'), default='ALL',
               help='draw the layers of this phase (default ALL)')
    if command == 'upgrade':
        p.add_argument('source', help='a net prototxt, a binary caffemodel or a solver prototxt')
        p.add_argument('target', help='where the upgraded file goes (the same form: text or '
                                      'binary)')
    return p


def parse(command, argv):
    args = _parser(command).parse(argv)
    if hasattr(args, 'stage'):
        args.stage = [s for group in args.stage for s in group]
    return args


# ---- train ---------------------------------------------------------------------------------
class SignalRequests:
    """Turns SIGINT/SIGHUP into requests the training loop reads between iterations; the
    previous handlers come back on close."""

    def __init__(self, sigint_effect, sighup_effect):
        self.pending = None
        self.effects = {signal.SIGINT: sigint_effect, signal.SIGHUP: sighup_effect}
        self._previous = {signum: signal.signal(signum, self._handle)
                          for signum, effect in self.effects.items() if effect != 'none'}

    def _handle(self, signum, frame):
        self.pending = self.effects[signum]

    def take(self):
        request, self.pending = self.pending, None
        return request

    def close(self):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def train(args):
    setup_logging(args.log_file)
    if args.weights and args.snapshot:
        raise CaffeError('%s train: give -weights (to finetune) or -snapshot (to resume), not '
                         'both' % PROG)
    weights = _paths(args.weights)
    _require_files([('-solver', args.solver), ('-snapshot', args.snapshot)] +
                   [('-weights', path) for path in weights])
    from .solvers import load_solver_param
    from .training import get_solver
    devices = _train_devices(args, load_solver_param(args.solver))
    solver = get_solver(args.solver, devices=devices, sync_bn=args.sync_bn, level=args.level,
                        stages=args.stage,
                        weights=weights if (args.weights or args.snapshot) else None)
    solver.nan_effect = args.nan_effect
    requests = None
    try:
        if args.snapshot:               # before the bar, so that it starts at the restored iter
            log.info('Resuming from %s', args.snapshot)
            solver.restore(args.snapshot)
        requests = SignalRequests(args.sigint_effect, args.sighup_effect)
        log.info('Starting Optimization')
        with progress_bar(solver.param.max_iter, solver.iter) as bar:
            solver.action_request = functools.partial(_advance, solver, requests, bar)
            solver.solve()
    finally:
        if requests is not None:
            requests.close()
        solver.close()
    return 0


def _advance(solver, requests, bar):
    """The solver asks between iterations (and test batches): move the bar, pass on signals."""
    if bar is not None and solver.iter > bar.n:
        bar.set_postfix_str('loss %.4g' % solver.smoothed_loss, refresh=False)
        bar.update(solver.iter - bar.n)
    return requests.take()


def _train_devices(args, solver_param):
    """The devices argument of get_solver: -gpu, -cpu_devices, or the solver's solver_mode
    and device_id, which caffe train follows when -gpu is not given."""
    if args.gpu is not None:
        return 'gpu:' + _gpu_spec(args.gpu)
    if args.cpu_devices is not None:
        return 'cpu:%d' % args.cpu_devices
    from . import caffe_pb2
    from .backend import gpu_count
    if solver_param.HasField('solver_mode') and \
            solver_param.solver_mode == caffe_pb2.SolverParameter.GPU:
        if gpu_count():
            return 'gpu:%d' % solver_param.device_id
        log.warning('%s says solver_mode: GPU, but no GPU is available here (%s); training on '
                    'the CPU', args.solver, _no_gpu_reason())
    return 'cpu:1'


def _gpu_spec(gpu):
    """'0,1' or 'all' for a -gpu value, once a GPU is known to be there."""
    from .backend import gpu_count
    shown = 'all' if gpu == 'all' else ','.join(map(str, gpu))
    count = gpu_count()
    if not count:
        raise CaffeError('-gpu %s: no GPU is available here (%s); for virtual CPU devices use '
                         '-cpu_devices N' % (shown, _no_gpu_reason()))
    missing = [] if gpu == 'all' else sorted({i for i in gpu if i >= count})
    if missing:
        raise CaffeError('-gpu %s: GPU %d does not exist (%d visible: 0 to %d)'
                         % (shown, missing[0], count, count - 1))
    return shown


def _no_gpu_reason():
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed: pip install 'caffe-syncbn[gpu]'"
    return 'CuPy sees no CUDA device'


# ---- test and time ---------------------------------------------------------------------------
def _select_device(args):
    """pycaffe's set_mode_cpu/set_mode_gpu + set_device for the one net of test and time;
    returns caffe's lines that say which device, to log once the net is built (so that a
    bad net file stays a one-line error)."""
    import caffe_syncbn
    if args.gpu is None:
        caffe_syncbn.set_mode_cpu()
        return ['Use CPU.']
    from .backend import gpu_count
    from .parallel import gpu_name
    _gpu_spec(args.gpu)
    ids = list(range(gpu_count())) if args.gpu == 'all' else args.gpu
    caffe_syncbn.set_mode_gpu()
    caffe_syncbn.set_device(ids[0])
    lines = ['Use GPU with device ID %d' % ids[0], 'GPU device name: %s' % gpu_name(ids[0])]
    if len(ids) > 1:
        lines.append('-gpu %s: one net runs on one device, GPU %d' % (','.join(map(str, ids)), ids[0]))
    return lines


def _build_on(devices, build, weights=()):
    """``build()``, loading ``weights`` into the net, then caffe's device lines and the time
    taken: logged once all went well, so that a bad file stays a one-line error."""
    start = time.perf_counter()
    net = build()
    for path in weights:
        net.copy_from(path)
    for line in devices:
        log.info('%s', line)
    log.info("Network initialization done: net '%s', %d layers%s, in %.2f s", net.name,
             len(net.layers), ', weights from %s' % ', '.join(weights) if weights else '',
             time.perf_counter() - start)
    return net


def test(args):
    setup_logging()
    weights = _paths(args.weights)
    _require_files([('-model', args.model)] + [('-weights', path) for path in weights])
    devices = _select_device(args)
    import numpy as np

    from . import TEST, TRAIN, Net
    from .backend import to_numpy
    net = _build_on(devices, lambda: Net(args.model, TEST if args.phase == 'TEST' else TRAIN,
                                         level=args.level or 0, stages=args.stage), weights)
    if net.inputs:
        log.warning('Input blobs %s are not filled by the net; they stay zero',
                    ', '.join(net.inputs))
    log.info('Running for %d iterations.', args.iterations)
    sums, loss = None, 0.0
    for i in range(args.iterations):
        loss += net.forward_prefilled()
        batch = [(name, to_numpy(net.blobs[name].data).astype(np.float64).ravel())
                 for name in net.outputs]
        for name, values in batch:
            for value in values:
                log.info('Batch %d, %s = %g', i, name, value)
        sums = batch if sums is None else [(n, s + v) for (n, s), (_, v) in zip(sums, batch)]
    log.info('Loss: %g', loss / args.iterations)
    for name, total in sums:
        weight = net.output_blob_loss_weights.get(name, 0)
        for mean in total / args.iterations:
            extra = ' (* %g = %g loss)' % (weight, weight * mean) if weight else ''
            log.info('%s = %g%s', name, mean, extra)
    return 0


def time_command(args):
    """caffe time's lines: an initial pass, then per-iteration, per-layer and average times."""
    setup_logging()
    _require_files([('-model', args.model)])
    devices = _select_device(args)
    from .timing import time_net
    from .tools_common import build_timing_net
    net = _build_on(devices, lambda: build_timing_net(args.model, args.batch, args.phase,
                                              args.level or 0, args.stage))
    log.info('Performing Forward')
    log.info('Initial loss: %g', net.forward_prefilled())
    log.info('Performing Backward')
    net.backward_from()
    log.info('*** Benchmark begins ***')
    log.info('Testing for %d iterations.', args.iterations)
    result = time_net(net, args.iterations, warmup=0)
    for j, seconds in enumerate(result['iterations']):
        log.info('Iteration: %d forward-backward time: %g ms.', j + 1, seconds * 1e3)
    log.info('Average time per layer: ')
    for (name, forward), (_, backward) in zip(result['forward'], result['backward']):
        log.info('%10s\tforward: %g ms.', name, forward * 1e3)
        log.info('%10s\tbackward: %g ms.', name, backward * 1e3)
    log.info('Average Forward pass: %g ms.', result['forward_total'] * 1e3)
    log.info('Average Backward pass: %g ms.', result['backward_total'] * 1e3)
    log.info('Average Forward-Backward: %g ms.', result['total'] * 1e3)
    log.info('Total Time: %g ms.', sum(result['iterations']) * 1e3)
    log.info('*** Benchmark ends ***')
    return 0


# ---- device_query, convert, draw, upgrade ------------------------------------------------------
#: Caffe's DeviceQuery lines: (label, key of CUDA's device properties)
_GPU_PROPERTIES = [('Major revision number', 'major'), ('Minor revision number', 'minor'),
                   ('Name', 'name'), ('Total global memory', 'totalGlobalMem'),
                   ('Total shared memory per block', 'sharedMemPerBlock'),
                   ('Total registers per block', 'regsPerBlock'), ('Warp size', 'warpSize'),
                   ('Maximum memory pitch', 'memPitch'),
                   ('Maximum threads per block', 'maxThreadsPerBlock'),
                   ('Maximum dimension of block', 'maxThreadsDim'),
                   ('Maximum dimension of grid', 'maxGridSize'), ('Clock rate', 'clockRate'),
                   ('Total constant memory', 'totalConstMem'),
                   ('Texture alignment', 'textureAlignment'),
                   ('Concurrent copy and execution', 'deviceOverlap'),
                   ('Number of multiprocessors', 'multiProcessorCount'),
                   ('Kernel execution timeout', 'kernelExecTimeoutEnabled')]


def device_query(args):
    setup_logging()
    from .backend import gpu_count
    if args.gpu is None:
        count = gpu_count()
        log.info('CPU: %d cores; -cpu_devices N trains on N virtual devices (threads)',
                 os.cpu_count() or 1)
        log.info('GPUs: %d%s', count, ' (-gpu all, or -gpu 0,1,..., for their details)' if count
                 else ' (%s)' % _no_gpu_reason())
        return 0
    log.info('Querying GPUs %s', _gpu_spec(args.gpu))
    import cupy
    for index in (range(gpu_count()) if args.gpu == 'all' else args.gpu):
        properties = cupy.cuda.runtime.getDeviceProperties(index)
        log.info('Device id:                     %d', index)
        for label, key in _GPU_PROPERTIES:
            value = properties.get(key, '?')
            if isinstance(value, bytes):
                value = value.decode(errors='replace')
            if key in ('deviceOverlap', 'kernelExecTimeoutEnabled'):
                value = 'Yes' if value else 'No'
            if isinstance(value, (list, tuple)):
                value = ', '.join(map(str, value))
            log.info('%-31s%s', label + ':', value)
    return 0


def convert(argv):
    """The model converter (convert/command.py), with gflags spellings of its flags."""
    from .convert import command
    setup_logging()
    prog = '%s convert' % PROG
    return command.main(normalize(argv, command.build_parser(prog)), prog=prog)


def draw(args):
    setup_logging()
    _require_files([('model', args.model)])
    try:
        from .pycaffe.draw import draw_net_to_file
    except ImportError as exc:
        raise CaffeError('draw needs caffe_syncbn.pycaffe.draw, which this installation '
                         'lacks (%s)' % exc) from None
    from . import caffe_pb2
    from .net import load_net_param
    phase = {'TRAIN': caffe_pb2.TRAIN, 'TEST': caffe_pb2.TEST, 'ALL': None}[args.phase]
    log.info('Drawing net to %s', args.output)
    draw_net_to_file(load_net_param(args.model), args.output, rankdir=args.rankdir, phase=phase)
    return 0


def upgrade(args):
    setup_logging()
    _require_files([('source', args.source)])
    from .upgrade import upgrade_file
    upgrade_file(args.source, args.target)
    return 0


# ---- the command -----------------------------------------------------------------------------
_RUN = {'train': train, 'test': test, 'time': time_command, 'device_query': device_query,
        'draw': draw, 'upgrade': upgrade}


def main(argv=None):
    """``caffe-syncbn COMMAND [flags]``: returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if a in COMMANDS), None)
    if command is None:
        if argv and argv[0].lstrip('-') not in ('h', 'help', 'helpfull', 'helpshort'):
            raise CaffeError(_unknown_command(argv))
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 1
    argv.remove(command)                 # gflags reads flags before the command too
    if command == 'convert':
        return convert(argv)
    return _RUN[command](parse(command, argv))


def usage():
    lines = ['%s: Caffe models on numpy or CuPy, trained data-parallel with SyncBN' % PROG,
             'usage: %s <command> <args>' % PROG, '', 'commands:']
    lines += ['  %-14s  %s' % item for item in COMMANDS.items()]
    lines += ['', 'Flags take every gflags spelling (-f v, -f=v, --f v, --f=v); '
              '"%s <command> -help" lists a command\'s flags.' % PROG]
    return '\n'.join(lines)


def _unknown_command(argv):
    import difflib
    word = next((a for a in argv if not a.startswith('-')), argv[0])
    close = difflib.get_close_matches(word, list(COMMANDS), n=1)
    return '%s: unknown command %r; %s' % (
        PROG, word, 'did you mean %s?' % close[0] if close else
        'the commands are %s' % ', '.join(COMMANDS))


def _paths(text):
    return [p.strip() for p in (text or '').split(',') if p.strip()]


def _require_files(flags):
    for flag, path in flags:
        if path is not None and not os.path.isfile(path):
            raise CaffeError('%s %s: no such file' % (flag, path))


def console_main():
    """The ``caffe-syncbn`` console script."""
    run_main(main)


if __name__ == '__main__':
    console_main()
