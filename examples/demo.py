#!/usr/bin/env python3
"""The main job (`make demo`): train the example segmentation net with SyncBN.

Generates the synthetic dataset, trains examples/segmentation/fcn_bn.prototxt with
`tools/train_net.py --sync-bn` on 4 virtual CPU devices (all GPUs when there are any),
then scores the held-out images and plots the log. Everything lands in out/demo/.
"""
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, 'examples', 'segmentation')
OUT = os.path.join(ROOT, 'out', 'demo')
sys.path.insert(0, ROOT)
sys.path.insert(0, EXAMPLE)


def run(args, **kwargs):
    print('$ ' + ' '.join(args), flush=True)
    subprocess.run([sys.executable] + args, check=True, **kwargs)


def solver_for_demo():
    """The example solver with its snapshots sent to out/demo."""
    with open(os.path.join(EXAMPLE, 'solver.prototxt')) as f:
        text = f.read()
    text = text.replace('snapshot_prefix: "fcn_bn"',
                        'snapshot_prefix: "%s"' % os.path.join(OUT, 'fcn_bn'))
    path = os.path.join(OUT, 'solver.prototxt')
    with open(path, 'w') as f:
        f.write(text)
    return path, int(text.split('max_iter:')[1].split()[0])


def main():
    from caffe_syncbn.backend import gpu_count
    os.makedirs(OUT, exist_ok=True)
    start = time.time()
    run([os.path.join(EXAMPLE, 'make_dataset.py')])
    solver, max_iter = solver_for_demo()
    log = os.path.join(OUT, 'train.log')
    if os.path.exists(log):
        os.remove(log)
    devices = ['--gpus', 'all'] if gpu_count() else ['--cpu-devices', '4']
    run([os.path.join(ROOT, 'tools', 'train_net.py'), '--solver', solver, '--sync-bn',
         '--log-file', log] + devices, cwd=EXAMPLE)
    trained = time.time()
    weights = os.path.join(OUT, 'fcn_bn_iter_%d.caffemodel' % max_iter)
    os.chdir(EXAMPLE)
    from evaluate import evaluate
    accuracy, miou, iou = evaluate(weights)
    run([os.path.join(ROOT, 'tools', 'plot_log.py'), log, '--output-dir', OUT])
    print()
    print('Held-out images: pixel accuracy %.4f, mean IoU %.4f (per class: %s)'
          % (accuracy, miou, ', '.join('%.3f' % v for v in iou)))
    print('Training took %.0f s on %s; the whole demo %.0f s.'
          % (trained - start, ' '.join(devices[0:2]).lstrip('-'), time.time() - start))
    print('Snapshot: %s' % weights)
    print('Log:      %s' % log)
    print('Plot:     %s' % (log + '.png'))


if __name__ == '__main__':
    main()
