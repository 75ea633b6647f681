#!/usr/bin/env python3
"""Convert a Caffe model: to-syncbn, to-batchnorm, fold-bn, to-deploy, to-onnx.

    python tools/convert_model.py fold-bn --model deploy.prototxt --weights net.caffemodel --output folded

See caffe_syncbn/cli/convert.py for every flag, or run with --help.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn.cli.common import run_main  # noqa: E402
from caffe_syncbn.cli.convert import main  # noqa: E402
from caffe_syncbn.glog import setup_logging  # noqa: E402

if __name__ == '__main__':
    setup_logging()
    run_main(main)
