#!/usr/bin/env python3
"""Score a trained net on its test data: ``caffe-syncbn test`` (caffe_syncbn/cli.py).

    python tools/test_net.py -model train_val.prototxt -weights net.caffemodel -iterations 50

Logs, as caffe test does, every output of every batch ("Batch 3, accuracy = 0.98"), the
mean loss ("Loss: 0.05") and the mean of each output ("accuracy = 0.9856").
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn.cli import main  # noqa: E402
from caffe_syncbn.cli.common import run_main  # noqa: E402

if __name__ == '__main__':
    run_main(lambda: main(['test'] + sys.argv[1:]))
