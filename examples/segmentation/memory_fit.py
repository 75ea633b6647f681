"""How many training images of a segmentation size fit on one device, with the memory plan
the demo trains with and without any: peak resident memory of one TRAIN step of
fcn_bn.prototxt at batch 1 and 2 (benchmarks/memory.py, each in a process of its own)
gives the memory per image and what does not grow with the batch.

    python examples/segmentation/memory_fit.py [--size 512] [--budget-gib 8]
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NET = os.path.join(ROOT, 'examples', 'segmentation', 'fcn_bn.prototxt')
MEMORY = os.path.join(ROOT, 'benchmarks', 'memory.py')
#: the plan of `caffe-syncbn train` (its -memory_plan default), and Caffe's way
PLANS = (('auto', 'with the memory plan'), ('off', 'without (as Caffe)'))


def peak_mib(plan, batch, size):
    out = subprocess.run([sys.executable, MEMORY, NET, '--batch', str(batch), '--steps', '1',
                          '--memory-plan', plan, '--input-size', '%d,%d' % (size, size)],
                         check=True, capture_output=True, text=True).stdout
    return int(re.search(r'^PEAK_KB (\d+)', out, re.M).group(1)) / 1024.0


def images_per_device(size=512, budget_gib=8.0):
    """{plan: (MiB per image, images within the budget)}."""
    fits = {}
    for plan, _ in PLANS:
        one, two = peak_mib(plan, 1, size), peak_mib(plan, 2, size)
        per_image = two - one
        fits[plan] = per_image, int((budget_gib * 1024 - (one - per_image)) // per_image)
    return fits


def report(size=512, budget_gib=8.0):
    fits = images_per_device(size, budget_gib)
    lines = ['Training images of %dx%d per device in %g GiB (fcn_bn, one TRAIN step):'
             % (size, size, budget_gib)]
    for plan, label in PLANS:
        per_image, count = fits[plan]
        lines.append('  %-22s %5d  (%.0f MiB per image, -memory_plan %s)'
                     % (label, count, per_image, plan))
    return lines


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--size', type=int, default=512, help='image side (default 512)')
    parser.add_argument('--budget-gib', type=float, default=8.0, help='device memory (8)')
    args = parser.parse_args()
    print('\n'.join(report(args.size, args.budget_gib)))
