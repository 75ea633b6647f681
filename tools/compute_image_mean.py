#!/usr/bin/env python3
"""Compute the mean image of an LMDB of Caffe Datum records, as Caffe's compute_image_mean.

    python tools/compute_image_mean.py DB_NAME [mean.binaryproto]

Writes a 1 x C x H x W BlobProto (written to a temporary file, then renamed) and logs the
mean of each channel, the numbers to use as transform_param.mean_value.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn.cli.common import run_main  # noqa: E402
from caffe_syncbn.errors import CaffeError  # noqa: E402
from caffe_syncbn.glog import setup_logging  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('db_name', metavar='DB_NAME', help='the LMDB folder')
    p.add_argument('output', metavar='OUTPUT_FILE', nargs='?',
                   help='the .binaryproto to write (omit to only log the channel means)')
    p.add_argument('--backend', default='lmdb', help='only lmdb is supported')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    log = setup_logging()
    if args.backend.lower() != 'lmdb':
        raise CaffeError('--backend %s is not supported; use lmdb' % args.backend)
    if args.output:
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder):
            raise CaffeError('the folder %s of the output file does not exist' % folder)
    from caffe_syncbn.data.imageset import compute_image_mean
    compute_image_mean(args.db_name, args.output, log=log.info)
    if args.output:
        log.info('Wrote the mean image to %s', args.output)
    return 0


if __name__ == '__main__':
    run_main(main)
