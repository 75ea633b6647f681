"""Train the demo net twice, with SyncBN and with per-device BN, and compare the two.

``run_pair(out, data, seed)`` writes into ``out``:
  fcn_bn.prototxt, solver.prototxt  the example net and solver, with the data paths made
                                    absolute and the solver's random_seed set to ``seed``;
                                    BOTH runs use these two files
  init.caffemodel                   the initial weights of both runs (fillers seeded with
                                    ``seed``)
  syncbn/, per-device/              one folder per run: train.log and the final snapshot
  results.json                      both runs: command, held-out pixel accuracy, mean IoU;
                                    for per-device BN also the mean IoU with each image
                                    normalized by its own statistics, as in its training
The two runs differ in one thing, the `--sync-bn` flag of tools/train_net.py. The data
order and augmentation come from the solver's random_seed, so both see the same images
in the same order; the initial weights come from the one file.
``plot_pair`` draws both runs' loss and test curves in one PNG.
"""
import collections
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.dirname(os.path.abspath(__file__))
TRAIN_NET = os.path.join(ROOT, 'tools', 'train_net.py')
sys.path.insert(0, ROOT)
sys.path.insert(0, EXAMPLE)

from evaluate import evaluate  # noqa: E402
from google.protobuf import text_format  # noqa: E402

import caffe_syncbn as caffe  # noqa: E402
from caffe_syncbn.caffe_pb2 import SolverParameter  # noqa: E402
from caffe_syncbn.analysis.logparse import TEST_OUTPUT, TESTING, parse_log  # noqa: E402
from caffe_syncbn.formats.atomic import atomic_write  # noqa: E402
from caffe_syncbn.netparam.prototxt import read_prototxt  # noqa: E402

#: (folder, label, the flags of tools/train_net.py that make the mode)
MODES = (('syncbn', 'SyncBN', ['--sync-bn']),
         ('per-device', 'per-device BN', []))


def demo_devices():
    """Four replicas of one image each: 4 virtual CPU devices, GPUs 0-3 where there are four
    GPUs or more, else GPU 0 four times (the same-GPU communicator)."""
    gpus = caffe.backend.gpu_count()
    if gpus >= 4:
        return ['--gpus', '0,1,2,3']
    if gpus:
        return ['--gpus', '0,0,0,0']
    return ['--cpu-devices', '4']


def write_net_and_solver(out, data, seed, solver_overrides=None):
    """The example net reading ``data`` (absolute paths) and the example solver training it
    with ``random_seed: seed`` and ``solver_overrides`` ({field: value}); their paths."""
    net = caffe.net.load_net_param(os.path.join(EXAMPLE, 'fcn_bn.prototxt'))
    for layer in net.layer:
        if layer.type == 'SegData':
            name = os.path.basename(layer.seg_data_param.source)
            layer.seg_data_param.source = os.path.join(data, name)
            layer.seg_data_param.root_dir = data + os.sep
    net_path = os.path.join(out, 'fcn_bn.prototxt')
    _write_text(net_path, net, 'examples/segmentation/fcn_bn.prototxt reading %s' % data)
    solver = read_prototxt(os.path.join(EXAMPLE, 'solver.prototxt'), SolverParameter())
    solver.net = net_path
    solver.random_seed = seed
    for field, value in (solver_overrides or {}).items():
        if field == 'test_iter':
            solver.test_iter[:] = [value]
        else:
            setattr(solver, field, value)
    solver_path = os.path.join(out, 'solver.prototxt')
    _write_text(solver_path, solver, 'examples/segmentation/solver.prototxt, random_seed %d' % seed)
    return net_path, solver_path


def _write_text(path, message, source):
    with atomic_write(path) as f:
        f.write(('# Written by examples/segmentation/compare.py from %s\n%s'
                 % (source, text_format.MessageToString(message))).encode())


def write_initial_weights(net_path, path, seed):
    """Both runs start from these weights: the net's fillers, seeded with ``seed``."""
    caffe.set_random_seed(seed)
    caffe.Net(net_path, caffe.TRAIN).save(path)
    return path


def say(line):
    print(line, flush=True)


def write_json(path, value):
    with atomic_write(path) as f:
        f.write(json.dumps(value, indent=1).encode())


def train(run_dir, solver_path, weights, flags, devices, label, progress=say):
    """Run tools/train_net.py in ``run_dir`` (where its snapshots land); show each test's
    pixel accuracy as it comes. Returns the command and the seconds it took."""
    os.makedirs(run_dir, exist_ok=True)
    log = os.path.join(run_dir, 'train.log')
    if os.path.exists(log):
        os.remove(log)                      # train_net appends to its log file
    command = [sys.executable, TRAIN_NET, '--solver', solver_path, '--weights', weights,
               '--log-file', log] + devices + flags
    start = time.time()
    tail = collections.deque(maxlen=20)     # shown if it fails
    with subprocess.Popen(command, cwd=run_dir, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as process:
        iteration = None
        for line in process.stderr:
            tail.append(line)
            testing, output = TESTING.search(line), TEST_OUTPUT.search(line)
            if testing:
                iteration = int(testing.group(1))
            elif output and output.group(1) == 'accuracy':
                progress('  %-13s iteration %5d: held-out pixel accuracy %.4f'
                         % (label, iteration, float(output.group(2))))
    if process.returncode:
        sys.stderr.write(''.join(tail))
        raise SystemExit('error: %s failed (exit %d); its log: %s'
                         % (' '.join(command), process.returncode, log))
    return command, time.time() - start


def final_snapshot(run_dir, solver_path):
    solver = read_prototxt(solver_path, SolverParameter())
    name = '%s_iter_%d.caffemodel' % (solver.snapshot_prefix, solver.max_iter)
    return os.path.join(run_dir, name)


def run_pair(out, data, seed, devices=None, solver_overrides=None, progress=say):
    """Train both modes from one initial caffemodel and score them on all of data/val.txt;
    returns (and writes to out/results.json) {mode folder: {label, command, weights, log,
    snapshot, seconds, pixel_accuracy, mean_iou, class_iou}}."""
    os.makedirs(out, exist_ok=True)
    devices = devices or demo_devices()
    net_path, solver_path = write_net_and_solver(out, data, seed, solver_overrides)
    init = write_initial_weights(net_path, os.path.join(out, 'init.caffemodel'), seed)
    with open(os.path.join(data, 'val.txt')) as f:
        held_out = sum(1 for line in f if line.strip())
    results = {}
    for folder, label, flags in MODES:
        run_dir = os.path.join(out, folder)
        command, seconds = train(run_dir, solver_path, init, flags, devices, label, progress)
        snapshot = final_snapshot(run_dir, solver_path)
        accuracy, miou, iou = evaluate(snapshot, net_path, held_out)
        run = results[folder] = {
            'label': label, 'command': command, 'weights': init,
            'log': os.path.join(run_dir, 'train.log'), 'snapshot': snapshot, 'seconds': seconds,
            'pixel_accuracy': float(accuracy), 'mean_iou': float(miou),
            'class_iou': [float(v) for v in iou]}
        progress('  %-13s done in %.0f s: held-out pixel accuracy %.4f, mean IoU %.4f'
                 % (label, seconds, accuracy, miou))
        if '--sync-bn' not in flags:   # the diagnostic: normalized as in its training
            run['own_statistics_mean_iou'] = float(
                evaluate(snapshot, net_path, held_out, own_statistics=True)[1])
    write_json(os.path.join(out, 'results.json'), results)
    return results


def plot_pair(path, results, title):
    """One PNG: training loss, held-out loss and held-out pixel accuracy of both runs."""
    import matplotlib
    matplotlib.use('Agg')
    from matplotlib.figure import Figure
    figure = Figure(figsize=(12, 3.9))
    train_axes, loss_axes, accuracy_axes = figure.subplots(1, 3)
    for (folder, _, _), colour in zip(MODES, ('tab:blue', 'tab:orange')):
        run = results[folder]
        train, test = parse_log(run['log'])
        label = '%s (mean IoU %.3f)' % (run['label'], run['mean_iou'])
        rows = [r for r in train if 'loss' in r]
        train_axes.plot([r['iteration'] for r in rows], [r['loss'] for r in rows],
                        color=colour, linewidth=1, label=label)
        for axes, name in ((loss_axes, 'loss'), (accuracy_axes, 'accuracy')):
            rows = [r for r in test if name in r]
            axes.plot([r['iteration'] for r in rows], [r[name] for r in rows], color=colour,
                      marker='o', markersize=3, label=label)
    for axes, name in ((train_axes, 'training loss (smoothed)'), (loss_axes, 'held-out loss'),
                       (accuracy_axes, 'held-out pixel accuracy')):
        axes.set_title(name, fontsize='medium')
        axes.set_xlabel('iteration')
        axes.grid(True, alpha=0.3)
    # one legend for the three panels, below them: inside any panel it would cover points
    figure.legend(*accuracy_axes.get_legend_handles_labels(), loc='lower center', ncol=2,
                  fontsize='small', frameon=False)
    figure.suptitle(title, fontsize='medium')
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    with atomic_write(path) as f:
        figure.savefig(f, format='png', dpi=80)
    return path
