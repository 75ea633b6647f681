#!/usr/bin/env python3
"""Convert a set of images to an LMDB of Caffe Datum records, as Caffe's convert_imageset.

    python tools/convert_imageset.py [options] ROOTFOLDER/ LISTFILE DB_NAME

LISTFILE has one "subfolder/file.jpg label" line per image; the file names are appended
to ROOTFOLDER as plain text, as Caffe does (so end it with '/'). Keys are
"%08d_<file name>" (the line number after --shuffle), so real Caffe reads the result.
The database is built in a temporary folder and renamed to DB_NAME when complete.
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
    p.add_argument('root', metavar='ROOTFOLDER/', help='prefix of the file names in LISTFILE')
    p.add_argument('list_file', metavar='LISTFILE', help='"file label" lines')
    p.add_argument('db_name', metavar='DB_NAME', help='the LMDB folder to create')
    p.add_argument('--gray', action='store_true', help='read the images as grayscale')
    p.add_argument('--shuffle', action='store_true', help='shuffle the order of the images')
    p.add_argument('--seed', type=int, default=0, help='random seed of --shuffle (default 0)')
    p.add_argument('--backend', default='lmdb', help='only lmdb is supported')
    p.add_argument('--resize_width', '--resize-width', type=int, default=0,
                   help='resize images to this width (with --resize_height)')
    p.add_argument('--resize_height', '--resize-height', type=int, default=0,
                   help='resize images to this height (with --resize_width)')
    p.add_argument('--check_size', '--check-size', action='store_true',
                   help='check that every image has the same size')
    p.add_argument('--encoded', action='store_true',
                   help='store encoded images (PNG/JPEG bytes) instead of raw pixels')
    p.add_argument('--encode_type', '--encode-type', default='',
                   help="format of encoded images ('png', 'jpg', ...); default: each file's own")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    log = setup_logging()
    if args.backend.lower() != 'lmdb':
        raise CaffeError('--backend %s is not supported; use lmdb' % args.backend)
    if args.resize_width < 0 or args.resize_height < 0:
        raise CaffeError('--resize_width and --resize_height must be >= 0')
    if args.encode_type and not args.encoded:
        raise CaffeError('--encode_type needs --encoded')
    if not os.path.isfile(args.list_file):
        raise CaffeError('list file %s does not exist' % args.list_file)
    from caffe_syncbn.data.imageset import convert_imageset
    count = convert_imageset(args.root, args.list_file, args.db_name,
                             resize_height=args.resize_height, resize_width=args.resize_width,
                             gray=args.gray, shuffle=args.shuffle, encoded=args.encoded,
                             encode_type=args.encode_type, check_size=args.check_size,
                             seed=args.seed, log=log.info, warn=log.warning)
    log.info('Wrote %d records to %s', count, args.db_name)
    return 0


if __name__ == '__main__':
    run_main(main)
