"""The ``caffe-syncbn`` command: Caffe's ``caffe`` tool, with its subcommands and flags.

    caffe-syncbn train -solver solver.prototxt [-gpu 0,1 | -cpu_devices 4] [-sync_bn | -async]
    mpiexec -n 2 caffe-syncbn train ...      (every process's devices join one run)
    caffe-syncbn test -model train_val.prototxt -weights net.caffemodel [-iterations 50]
    caffe-syncbn time -model net.prototxt [-iterations 50]
    caffe-syncbn precise_bn -model train_val.prototxt -weights in.caffemodel -output out.caffemodel
    caffe-syncbn device_query [-gpu all]
    caffe-syncbn convert to-syncbn|to-batchnorm|fold-bn|to-deploy|to-onnx -model ... -output ...
    caffe-syncbn draw net.prototxt net.png [-rankdir LR] [-phase TRAIN|TEST|ALL]
    caffe-syncbn upgrade old.prototxt|old.caffemodel|old_solver.prototxt new_file

Flags take every gflags spelling (see flags.py); tools/train_net.py, test_net.py and
time_net.py are this command's train, test and time.
"""
import difflib
import functools
import logging
import os
import sys
import time
import traceback

import numpy as np

from .. import TEST, TRAIN, Net, __version__, caffe_pb2
from ..analysis.timing import build_timing_net, time_net
from ..backend import to_numpy
from ..blob import out_of_memory_text
from ..comm.mpi import ending_job_on_error, job_link
from ..errors import CaffeError
from ..formats.regular import require_regular
from ..glog import setup_logging
from ..memory_planner import DEFAULT_PLAN, MEMORY_PLANS, describe_plans
from ..netparam.upgrade import load_net_param
from ..netparam.upgrade_file import upgrade_file
from ..precision import PRECISIONS
from ..pycaffe.draw import draw_net_to_file
from ..training.precise_bn import PreciseBN
from ..training.rules import rule_class
from ..training.solvers import checked_solver_param, get_solver
from . import convert as convert_command
from .common import progress_bar, run_main
from .devices import device_query, select_device, train_devices
from .flags import FlagParser, gpu_ids, non_negative_int, normalize, positive_int, stage_list
from .signals import SignalRequests, exit_status, log_sigterm

log = logging.getLogger('caffe_syncbn')

PROG = 'caffe-syncbn'
VERSION_FLAGS = ('-version', '--version')
EFFECTS = ('stop', 'snapshot', 'none')
COMMANDS = {
    'train': 'train or finetune a model',
    'test': 'score a model',
    'device_query': 'show the devices (GPU diagnostic information with -gpu)',
    'time': 'benchmark model execution time',
    'precise_bn': "re-estimate every batch norm's running statistics over K global batches",
    'convert': 'convert a model: to-syncbn, to-batchnorm, fold-bn, to-deploy, to-onnx',
    'draw': 'draw a net as a PNG, SVG or PDF diagram',
    'upgrade': 'upgrade a V1 or old-style net prototxt, caffemodel or solver prototxt',
}


# ---- flags ---------------------------------------------------------------------------------
def _parser(command):
    """The flags of ``command``, named as caffe names them (see the README's flag table)."""
    p = FlagParser('%s %s' % (PROG, command), COMMANDS[command])
    if command in ('train', 'test', 'time', 'device_query', 'precise_bn'):
        where = p.add_mutually_exclusive_group()
        where.add_argument('-gpu', dest='gpu', type=gpu_ids, metavar='IDS',
                           help="GPU ids separated by ',', or 'all'" + {
                               'train': ' (a repeated id runs replicas on one GPU)',
                               'precise_bn': ' (a repeated id runs replicas on one GPU)',
                               'device_query': ' (the GPUs to describe)'}.get(
                                   command, ' (the first runs the net)'))
        if command in ('train', 'precise_bn'):
            where.add_argument('-cpu_devices', dest='cpu_devices', metavar='N',
                               type=positive_int('devices'),
                               help='virtual CPU devices, threads (1 when no GPU is asked for)')
        elif command != 'device_query':
            where.add_argument('-cpu', dest='cpu', action='store_true', help='run on the CPU '
                                                                              '(the default)')
        if command != 'device_query':
            p.flag('tf32', action='store_true', help='with -gpu: float32 GEMMs and convolutions '
                   'may round their inputs to TF32 (CUPY_TF32=1; docs/gpu.md)')
    if command == 'train':
        p.flag('solver', required=True, metavar='FILE', help='the solver prototxt')
        p.flag('weights', metavar='FILES', help="caffemodels to finetune from, separated by ',' "
                                                "(they replace the solver's weights)")
        p.flag('snapshot', metavar='FILE', help='the solverstate to resume from')
        p.flag('sync_bn', action='store_true', help='run every BatchNorm(+Scale) and BN as SyncBN')
        p.flag('sync_bn_group_size', type=positive_int('replicas'), metavar='K',
               help='SyncBN shares batch statistics within groups of K consecutive replicas '
                    '(1: per-device batch norm; default: all replicas); K divides the '
                    'replicas (docs/syncbn.md)')
        p.add_argument('-async', dest='async_updates', action='store_true',
                       help='asynchronous updates: each replica updates the shared params '
                            'without waiting for the others (not with -sync_bn)')
        p.flag('max_staleness', type=non_negative_int, metavar='K',
               help='with -async: a replica waits while it is more than K updates ahead of '
                    'the slowest (default: no bound)')
        for name, default in (('sigint_effect', 'stop'), ('sighup_effect', 'snapshot'),
                              ('sigterm_effect', 'snapshot'), ('nan_effect', 'none')):
            p.flag(name, choices=EFFECTS, default=default, help='what %s does (default %s%s)' % (
                'the first loss, gradient, param or statistic that is not finite'
                if name == 'nan_effect' else 'a ' + name.split('_')[0].upper(), default,
                ': a snapshot, then the run ends' if name == 'sigterm_effect' else ''))
        p.flag('precision', choices=PRECISIONS, default='float32',
               help='the activations and their diffs in float32 (the default), or in float16 '
                    '(with a dynamic loss scale) or bfloat16, the params, their updates, '
                    'batch-norm statistics and allreduces staying float32')
        p.flag('log_file', metavar='FILE', help='also append the log to this file')
    if command in ('test', 'time', 'precise_bn'):
        default_phase = 'TEST' if command == 'test' else 'TRAIN'
        iterations = 200 if command == 'precise_bn' else 50
        p.flag('model', required=True, metavar='FILE', help='the net prototxt')
        p.flag('iterations', type=positive_int('iterations'), default=iterations, metavar='N',
               help='the number of %s to run (default %d)' % (
                   'global batches' if command == 'precise_bn' else 'iterations', iterations))
        p.flag('phase', choices=('TRAIN', 'TEST'), default=default_phase,
               help='the net phase (default %s)' % default_phase)
    if command in ('test', 'precise_bn'):
        p.flag('weights', required=True, metavar='FILES', help="the caffemodels to %s, "
               "separated by ','" % ('score' if command == 'test' else 'load'))
    if command == 'precise_bn':
        p.flag('output', required=True, metavar='FILE', help='the caffemodel to write (HDF5 '
                                                             'for a name ending in .h5)')
    if command == 'time':
        p.flag('batch', type=positive_int('rows'), metavar='N',
               help="the batch size (default: the prototxt's)")
        p.flag('input_shape', type=convert_command.parse_shape, metavar='N,C,H,W',
               help="the data's shape (default: what the data layers' sources give)")
    if command in ('train', 'test', 'time', 'precise_bn'):
        p.flag('level', type=int, metavar='N', help='the NetState level')
        p.flag('stage', type=stage_list, action='append', default=[], metavar='S',
               help="NetState stages separated by ',' (the flag may repeat)")
    if command in ('train', 'test', 'time'):
        plans = describe_plans(DEFAULT_PLAN['command'], 'the default, unless the solver '
                               'file sets memory_plan' if command == 'train' else 'the default')
        p.flag('memory_plan', choices=MEMORY_PLANS, help=plans.replace('%', '%%'))  # argparse's %
    if command == 'draw':
        p.add_argument('model', help='the net prototxt')
        p.add_argument('output', help='the file to write: its extension (png, svg, pdf, dot) '
                                      'names the format')
        p.flag('rankdir', default='LR', choices=('LR', 'RL', 'TB', 'BT'),
               help='the direction of the diagram (default LR: left to right)')
        p.flag('phase', choices=('TRAIN', 'TEST', 'ALL'), default='ALL',
               help="draw this phase's layers (default ALL)")
    if command == 'upgrade':
        p.add_argument('source', help='a net prototxt, a binary caffemodel or a solver prototxt')
        p.add_argument('target', help='the upgraded file, in the same form (text or binary)')
    return p


def parse(command, argv):
    args = _parser(command).parse(argv)
    if hasattr(args, 'stage'):
        args.stage = [s for group in args.stage for s in group]
    return args


# ---- train ---------------------------------------------------------------------------------
def train(args):
    """caffe train; under mpiexec or srun, this process's part of one run
    (training/data_parallel.py)."""
    return _in_job(_train, args)


def _in_job(run, args):
    """``run(args)``; under mpiexec or srun, as this process's part of one job. In a job of
    several processes, an error ends every process: this one prints it and calls
    MPI_Abort, so that none waits for ever in a collective."""
    link = job_link()
    if link is not None and link.rank > 0:
        _log_as_rank(link.rank)
    with ending_job_on_error(link, functools.partial(_report, link)):
        status = run(args)
        if link is not None:
            link.close()
    return status


def _log_as_rank(rank):
    """Processes other than 0 log warnings and errors only, each line naming its rank."""
    logger = logging.getLogger('caffe_syncbn')
    logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))

    def prefix(record):
        record.msg = '[rank %d] %s' % (rank, record.msg)
        return True
    logger.addFilter(prefix)


def _report(link, exc):
    """The error line the command prints (as run_main does), naming the rank."""
    if isinstance(exc, (CaffeError, FileNotFoundError)):
        text = 'error: %s' % exc
    elif isinstance(exc, MemoryError):
        text = 'error: %s' % out_of_memory_text(exc)
    elif isinstance(exc, KeyboardInterrupt):
        text = 'interrupted'
    else:
        text = ''.join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    print('[rank %d] %s' % (link.rank, text), file=sys.stderr, flush=True)


def _train(args):
    if args.weights and args.snapshot:
        raise CaffeError('%s train: give -weights (to finetune) or -snapshot (to resume), not '
                         'both' % PROG)
    weights = _paths(args.weights)
    _require_files([('-solver', args.solver), ('-snapshot', args.snapshot)] +
                   [('-weights', path) for path in weights])
    param = checked_solver_param(args.solver)
    devices = train_devices(args, param)
    # as caffe train: -weights replace the solver's weights, and -snapshot drops them
    solver = get_solver(args.solver, devices=devices, sync_bn=args.sync_bn, level=args.level,
                        stages=args.stage, weights=weights if args.weights or args.snapshot
                        else None, mode='async' if args.async_updates else 'sync',
                        max_staleness=args.max_staleness, memory_plan=args.memory_plan or
                        param.memory_plan or DEFAULT_PLAN['command'],
                        sync_bn_group_size=args.sync_bn_group_size, precision=args.precision)
    solver.nan_effect = args.nan_effect
    requests = None
    try:
        if solver.net.inputs:
            raise CaffeError('%s train: the train net has Input blobs (%s), and a command line '
                             'has nothing to fill them with; give the net a data layer (Data, '
                             'ImageData, HDF5Data, ...), or train in Python, where the solver '
                             "reads them (solver.net.blobs['%s'].data[...] = x on one device, "
                             'solver.set_data_source on several)'
                             % (PROG, ', '.join(map(repr, solver.net.inputs)), solver.net.inputs[0]))
        if args.snapshot:               # before the bar, so that it starts at the restored iter
            log.info('Resuming from %s', args.snapshot)
            solver.restore(args.snapshot)
        requests = SignalRequests(args.sigint_effect, args.sighup_effect, args.sigterm_effect)
        log.info('Starting Optimization')
        with progress_bar(solver.param.max_iter, solver.iter) as bar:
            solver.action_request = functools.partial(_advance, solver, requests, bar)
            solver.solve()
    finally:
        if requests is not None:
            requests.close()
        solver.close()
    return exit_status(solver, requests)


def _advance(solver, requests, bar):
    """The solver asks between iterations (and test batches): move the bar, pass on signals."""
    if bar is not None and solver.iter > bar.n:
        bar.set_postfix_str('loss %.4g' % solver.smoothed_loss, refresh=False)
        bar.update(solver.iter - bar.n)
    request = requests.take()
    if requests.sigterm_taken:
        log_sigterm(solver, request, time.monotonic() - requests.sigterm_at)
    return request


# ---- precise_bn ------------------------------------------------------------------------------
def precise_bn(args):
    """PreciseBN (training/precise_bn.py); under mpiexec, every process's devices join it."""
    return _in_job(_precise_bn, args)


def _precise_bn(args):
    weights = _paths(args.weights)
    _require_files([('-model', args.model)] + [('-weights', path) for path in weights])
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise CaffeError('-output %s: no folder %s to write it in' % (args.output, folder))
    with PreciseBN(args.model, weights, devices=train_devices(args),
                   phase=TEST if args.phase == 'TEST' else TRAIN, level=args.level or 0,
                   stages=args.stage) as job:
        with progress_bar(len(job.passes) * args.iterations) as bar:
            job.estimate(args.iterations, progress=bar.update if bar is not None else None)
        job.save(args.output)
    return 0


# ---- test and time ---------------------------------------------------------------------------
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
    weights = _paths(args.weights)
    _require_files([('-model', args.model)] + [('-weights', path) for path in weights])
    devices = select_device(args)
    net = _build_on(devices, lambda: Net(args.model, TEST if args.phase == 'TEST' else TRAIN,
                                         level=args.level or 0, stages=args.stage,
                                         memory_plan=args.memory_plan or DEFAULT_PLAN['command']),
                   weights)
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
    _require_files([('-model', args.model)])
    devices = select_device(args)
    net = _build_on(devices, lambda: build_timing_net(args.model, args.batch, args.phase,
                                                      args.level or 0, args.stage,
                                                      args.memory_plan or DEFAULT_PLAN['command'],
                                                      args.input_shape))
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


# ---- convert, draw, upgrade ------------------------------------------------------------------
def convert(argv):
    """The model converter (cli/convert.py), with gflags spellings of its flags."""
    prog = '%s convert' % PROG
    return convert_command.main(normalize(argv, convert_command.build_parser(prog)), prog=prog)


def draw(args):
    _require_files([('model', args.model)])
    phase = {'TRAIN': caffe_pb2.TRAIN, 'TEST': caffe_pb2.TEST, 'ALL': None}[args.phase]
    log.info('Drawing net to %s', args.output)
    draw_net_to_file(load_net_param(args.model), args.output, rankdir=args.rankdir, phase=phase)
    return 0


def upgrade(args):
    _require_files([('source', args.source)])
    upgrade_file(args.source, args.target, check_solver_type=rule_class)
    return 0


# ---- the command -----------------------------------------------------------------------------
_RUN = {'train': train, 'test': test, 'time': time_command, 'device_query': device_query,
        'draw': draw, 'upgrade': upgrade, 'precise_bn': precise_bn}


def main(argv=None):
    """``caffe-syncbn COMMAND [flags]``: returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in VERSION_FLAGS for a in argv):       # as gflags: wherever it stands
        print('%s version %s' % (PROG, __version__))
        return 0
    command = next((a for a in argv if a in COMMANDS), None)
    if command is None:
        if argv and argv[0].lstrip('-') not in ('h', 'help', 'helpfull', 'helpshort'):
            raise CaffeError(_unknown_command(argv))
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 1
    argv.remove(command)                 # gflags reads flags before the command too
    if command == 'convert':
        setup_logging()
        return convert(argv)
    args = parse(command, argv)
    setup_logging(getattr(args, 'log_file', None))
    try:
        return _RUN[command](args)
    except MemoryError as exc:       # where no layer or thread pool named it: one line still
        raise CaffeError(out_of_memory_text(exc)) from None


def usage():
    lines = ['%s: Caffe models on numpy or CuPy, trained data-parallel with SyncBN' % PROG,
             'usage: %s <command> <args>' % PROG, '', 'commands:']
    lines += ['  %-14s  %s' % item for item in COMMANDS.items()]
    lines += ['', 'Flags take every gflags spelling (-f v, -f=v, --f v, --f=v); '
              '"%s <command> -help" lists a command\'s flags, "%s -version" prints the '
              'version.' % (PROG, PROG)]
    return '\n'.join(lines)


def _unknown_command(argv):
    if argv[0].startswith('-'):        # flags, then perhaps their values: no command at all
        return '%s: no command given before or after %s; the commands are %s' % (
            PROG, argv[0], ', '.join(COMMANDS))
    word = argv[0]
    close = difflib.get_close_matches(word, list(COMMANDS), n=1)
    return '%s: unknown command %r; %s' % (
        PROG, word, 'did you mean %s?' % close[0] if close else
        'the commands are %s' % ', '.join(COMMANDS))


def _paths(text):
    return [p.strip() for p in (text or '').split(',') if p.strip()]


def _require_files(flags):
    for flag, path in flags:
        if path is None:
            continue
        if not os.path.exists(path):
            raise CaffeError('%s %s: no such file' % (flag, path))
        if os.path.isdir(path):
            raise CaffeError('%s %s: a folder, not a file' % (flag, path))
        require_regular(path, flag)


def console_main():
    """The ``caffe-syncbn`` console script."""
    run_main(main)


if __name__ == '__main__':
    console_main()
