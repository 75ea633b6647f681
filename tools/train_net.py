#!/usr/bin/env python3
"""Train a net from a solver prototxt, as `caffe train` does, on GPUs or virtual CPU devices.

    python tools/train_net.py --solver solver.prototxt --gpus 0,1,2,3 [--sync-bn]
    python tools/train_net.py --solver solver.prototxt --cpu-devices 4 --sync-bn
    python tools/train_net.py --solver solver.prototxt --snapshot net_iter_1000.solverstate

Logs use Caffe's line format (`Iteration N, loss = x`) on stderr and in --log-file.
"""
import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn.errors import CaffeError  # noqa: E402
from caffe_syncbn.tools_common import run_main, setup_logging  # noqa: E402

EFFECTS = ('stop', 'snapshot', 'none')


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--solver', required=True, help='solver prototxt')
    where = p.add_mutually_exclusive_group()
    where.add_argument('--gpus', help="GPU ids, e.g. 0,1,2,3, or 'all' (repeat an id, 0,0, for "
                                      'several replicas on one GPU)')
    where.add_argument('--cpu-devices', type=int, help='virtual CPU devices (threads); the '
                                                       'default when no GPU is asked for')
    p.add_argument('--weights', help='caffemodel(s) to finetune from, comma-separated')
    p.add_argument('--snapshot', help='solverstate to resume from')
    p.add_argument('--sync-bn', action='store_true',
                   help='turn every BatchNorm(+Scale) and BN layer into SyncBN')
    p.add_argument('--sigint-effect', choices=EFFECTS, default='stop')
    p.add_argument('--sighup-effect', choices=EFFECTS, default='snapshot')
    p.add_argument('--log-file', help='also write the log here')
    args = p.parse_args(argv)
    if args.weights and args.snapshot:
        p.error('give --weights or --snapshot, not both')
    return args


def devices_from(args):
    if args.gpus:
        if args.gpus == 'all':
            return 'gpu:all'
        return 'gpu:' + args.gpus
    return 'cpu:%d' % (args.cpu_devices or 1)


class SignalRequests:
    """Turns SIGINT/SIGHUP into requests the training loop reads between iterations."""

    def __init__(self, sigint_effect, sighup_effect):
        self.pending = None
        self.effects = {signal.SIGINT: sigint_effect, signal.SIGHUP: sighup_effect}
        for signum, effect in self.effects.items():
            if effect != 'none':
                signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        self.pending = self.effects[signum]

    def take(self):
        request, self.pending = self.pending, None
        return request


def main(argv=None):
    args = parse_args(argv)
    log = setup_logging(args.log_file)
    from caffe_syncbn.training import get_solver
    if not os.path.exists(args.solver):
        raise CaffeError('solver file %s does not exist' % args.solver)
    solver = get_solver(args.solver, devices=devices_from(args), sync_bn=args.sync_bn)
    if args.weights:
        for path in args.weights.split(','):
            solver.copy_weights(path)
    requests = SignalRequests(args.sigint_effect, args.sighup_effect)
    log.info('Starting Optimization')
    progress = None

    def take_request():                 # the solver asks between iterations (and test batches)
        if progress is not None:
            progress.update(solver.iter - progress.n)
        return requests.take()

    solver.action_request = take_request
    try:
        if args.snapshot:               # before the bar, so that it starts at the restored iter
            solver.restore(args.snapshot)
        progress = _progress_bar(solver.iter, solver.param.max_iter)
        solver.solve()
    finally:
        if progress is not None:
            progress.close()
        solver.close()
    return 0


def _progress_bar(start, total):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=start, unit='it', dynamic_ncols=True, leave=False)


if __name__ == '__main__':
    run_main(main)
