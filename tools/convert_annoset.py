#!/usr/bin/env python3
"""Convert images and their box annotations to an LMDB of AnnotatedDatum records, as the
SSD fork's convert_annoset.

    python tools/convert_annoset.py [options] ROOTFOLDER/ LISTFILE DB_NAME

LISTFILE has one "image annotation" pair a line, both appended to ROOTFOLDER as plain
text (so end it with '/'). Annotations are VOC xml, txt ("label xmin ymin xmax ymax" in
pixels a line) or json (--label_type); xml and json name their classes through
--label_map_file (a LabelMap prototxt). Keys are "%08d_<image name>", so the fork's
AnnotatedData layer reads the result. The database is built in a temporary folder and
renamed to DB_NAME when complete.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

from caffe_syncbn.cli.common import run_main  # noqa: E402
from caffe_syncbn.data.annotation import LABEL_TYPES, convert_annoset  # noqa: E402
from caffe_syncbn.errors import CaffeError  # noqa: E402
from caffe_syncbn.glog import setup_logging  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('root', metavar='ROOTFOLDER/', help='prefix of the names in LISTFILE')
    p.add_argument('list_file', metavar='LISTFILE', help='"image annotation" lines')
    p.add_argument('db_name', metavar='DB_NAME', help='the LMDB folder to create')
    p.add_argument('--anno_type', default='detection',
                   help='only detection (for classification use convert_imageset.py)')
    p.add_argument('--label_type', default='xml', choices=LABEL_TYPES,
                   help='format of the annotation files (default xml)')
    p.add_argument('--label_map_file', default='', help='LabelMap prototxt (xml, json)')
    p.add_argument('--gray', action='store_true', help='read the images as grayscale')
    p.add_argument('--shuffle', action='store_true', help='shuffle the order of the images')
    p.add_argument('--seed', type=int, default=0, help='random seed of --shuffle (default 0)')
    p.add_argument('--backend', default='lmdb', help='only lmdb is supported')
    p.add_argument('--min_dim', type=int, default=0, help='scale the short side up to this')
    p.add_argument('--max_dim', type=int, default=0, help='keep the long side within this')
    p.add_argument('--resize_width', type=int, default=0, help='resize to this width')
    p.add_argument('--resize_height', type=int, default=0, help='resize to this height')
    p.add_argument('--check_size', action='store_true', help='every image the same size')
    p.add_argument('--encoded', action='store_true', help='store PNG/JPEG bytes')
    p.add_argument('--encode_type', default='',
                   help="format of encoded images ('png', 'jpg'); default: each file's own")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    log = setup_logging()
    if args.backend.lower() != 'lmdb':
        raise CaffeError('--backend %s is not supported; use lmdb' % args.backend)
    if args.anno_type != 'detection':
        raise CaffeError('--anno_type %s is not supported: only detection (classification '
                         'lists go to tools/convert_imageset.py)' % args.anno_type)
    count = convert_annoset(args.root, args.list_file, args.db_name, args.label_map_file,
                            args.label_type, gray=args.gray, shuffle=args.shuffle,
                            resize_height=max(0, args.resize_height),
                            resize_width=max(0, args.resize_width),
                            min_dim=max(0, args.min_dim), max_dim=max(0, args.max_dim),
                            encoded=args.encoded, encode_type=args.encode_type,
                            check_size=args.check_size, seed=args.seed, log=log.info,
                            warn=log.warning)
    log.info('Wrote %d records to %s', count, args.db_name)
    return 0


if __name__ == '__main__':
    run_main(main)
