#!/usr/bin/env python3
"""Train a net from a solver prototxt: ``caffe-syncbn train`` (caffe_syncbn/cli.py).

    python tools/train_net.py -solver solver.prototxt -gpu 0,1,2,3 [-sync_bn]
    python tools/train_net.py -solver solver.prototxt -cpu_devices 4 -sync_bn
    python tools/train_net.py -solver solver.prototxt -snapshot net_iter_1000.solverstate

Caffe's flags in any gflags spelling; the older --gpus, --cpu-devices, --sync-bn also work.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn.cli import main  # noqa: E402
from caffe_syncbn.cli.common import run_main  # noqa: E402

if __name__ == '__main__':
    run_main(lambda: main(['train'] + sys.argv[1:]))
