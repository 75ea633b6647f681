#!/usr/bin/env python3
"""Time a net's forward and backward passes, layer by layer: ``caffe-syncbn time``
(caffe_syncbn/cli.py).

    python tools/time_net.py -model net.prototxt [-iterations 50] [-batch 8] [-gpu 0]
                             [-input_shape N,C,H,W]

Data layers become Input layers of the shapes their sources give (-batch rows, default
the prototxt's batch size; -input_shape where the sources are not at hand), weights come
from the fillers, backward is forced; the lines are caffe time's.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn.cli import main  # noqa: E402
from caffe_syncbn.cli.common import run_main  # noqa: E402

if __name__ == '__main__':
    run_main(lambda: main(['time'] + sys.argv[1:]))
