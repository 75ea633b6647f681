#!/usr/bin/env python3
"""Turn a Caffe training log (this package's or real Caffe's glog output) into CSV and a plot.

    python tools/plot_log.py train.log [--output-dir DIR] [--no-plot]

Writes LOG.train.csv (iteration, loss, lr), LOG.test.csv (iteration and every test
output) and LOG.png (loss, test outputs such as accuracy, and lr against iteration),
named after the log file, in DIR (default: the log's folder).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn.cli.common import run_main  # noqa: E402
from caffe_syncbn.analysis.logparse import (TRAIN_COLUMNS, parse_log, plot_curves,  # noqa: E402
                                       test_columns, write_csv)
from caffe_syncbn.errors import CaffeError  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('log', help='training log file')
    parser.add_argument('--output-dir', help="where to write (default: the log's folder)")
    parser.add_argument('--no-plot', action='store_true', help='write the CSV files only')
    args = parser.parse_args(argv)
    if not os.path.isfile(args.log):
        raise CaffeError('log file %s does not exist' % args.log)
    train, test = parse_log(args.log)
    folder = args.output_dir or os.path.dirname(os.path.abspath(args.log))
    stem = os.path.join(folder, os.path.basename(args.log))
    written = [stem + '.train.csv', stem + '.test.csv'] + ([] if args.no_plot else [stem + '.png'])
    try:
        os.makedirs(folder, exist_ok=True)
        write_csv(written[0], train, TRAIN_COLUMNS)
        write_csv(written[1], test, test_columns(test))
        if not args.no_plot:
            plot_curves(written[2], train, test, title=os.path.basename(args.log))
    except OSError as exc:
        raise CaffeError('cannot write to %s: %s' % (folder, exc.strerror)) from None
    print('%d train rows, %d test rows' % (len(train), len(test)))
    for path in written:
        print('wrote %s' % path)
    return 0


if __name__ == '__main__':
    run_main(main)
