#!/usr/bin/env python3
"""Records per second read by the checked LMDB reader, against py-lmdb's cursor.

    python benchmarks/lmdb_read.py [--records N] [--passes K]

Two databases of raw uint8 Datum records are written in a temporary folder: 3x16x16
(on leaf pages) and 3x64x64 (each on overflow pages). Each is read K times through
``LMDBReader.records()`` (pread, every page checked) and through py-lmdb (memory-mapped,
unchecked), and the ratio of the two times is printed.
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

import lmdb  # noqa: E402
import numpy as np  # noqa: E402

from caffe_syncbn.cli.common import run_main  # noqa: E402
from caffe_syncbn.data.datum import LMDBReader, array_to_datum, write_lmdb  # noqa: E402


def seconds(read, passes):
    start = time.perf_counter()
    total = sum(len(value) for _ in range(passes) for value in read())
    return time.perf_counter() - start, total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--records', type=int, default=20000)
    parser.add_argument('--passes', type=int, default=3)
    args = parser.parse_args(argv)
    rs = np.random.RandomState(0)
    with tempfile.TemporaryDirectory() as folder:
        for shape in ((3, 16, 16), (3, 64, 64)):
            path = os.path.join(folder, 'x'.join(map(str, shape)))
            write_lmdb(path, [[(b'%08d' % i, array_to_datum(
                rs.randint(0, 256, shape).astype(np.uint8), i).SerializeToString())
                for i in range(args.records)]], map_size=1 << 31)
            reader = LMDBReader(path)
            env = lmdb.open(path, readonly=True, lock=False)

            def unchecked():
                with env.begin() as txn:
                    for _, value in txn.cursor():
                        yield value
            ours, ours_bytes = seconds(lambda: (v for _, v in reader.records()), args.passes)
            theirs, their_bytes = seconds(unchecked, args.passes)
            assert ours_bytes == their_bytes
            count = args.records * args.passes
            print('%-8s checked %9.0f records/s, py-lmdb %9.0f records/s: %.2fx the time'
                  % ('x'.join(map(str, shape)), count / ours, count / theirs, ours / theirs))
            env.close()


if __name__ == '__main__':
    run_main(main)
