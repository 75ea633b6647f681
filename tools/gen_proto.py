#!/usr/bin/env python
"""Regenerate caffe_syncbn/caffe.pb (a binary FileDescriptorSet) from proto/caffe.proto.

    python tools/gen_proto.py           # rewrite caffe_syncbn/caffe.pb
    python tools/gen_proto.py --check   # exit 1 if the committed caffe.pb is stale

The command run is:

    python -m grpc_tools.protoc -Iproto --descriptor_set_out=caffe_syncbn/caffe.pb proto/caffe.proto

Source info is left out on purpose: the file stays small and its bytes depend
only on the schema.  --check compares the parsed descriptor sets rather than
raw bytes, so a different protoc build that serialises the same schema in
another order does not count as stale.
"""
import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO = os.path.join('proto', 'caffe.proto')
OUTPUT = os.path.join('caffe_syncbn', 'caffe.pb')


def generate(out_path):
    cmd = [sys.executable, '-m', 'grpc_tools.protoc', '-Iproto',
           '--descriptor_set_out=' + out_path, PROTO]
    result = subprocess.run(cmd, cwd=ROOT)
    if result.returncode != 0:
        sys.exit('protoc failed (%d): %s' % (result.returncode, ' '.join(cmd)))


def same_schema(path_a, path_b):
    with open(path_a, 'rb') as f:
        a = f.read()
    with open(path_b, 'rb') as f:
        b = f.read()
    if a == b:
        return True
    from google.protobuf import descriptor_pb2
    set_a = descriptor_pb2.FileDescriptorSet.FromString(a)
    set_b = descriptor_pb2.FileDescriptorSet.FromString(b)
    return set_a == set_b


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--check', action='store_true',
                        help='regenerate into a temp file and compare with %s' % OUTPUT)
    args = parser.parse_args(argv)

    if not args.check:
        generate(OUTPUT)
        print('wrote', OUTPUT)
        return 0

    committed = os.path.join(ROOT, OUTPUT)
    if not os.path.exists(committed):
        print('%s is missing; run: python tools/gen_proto.py' % OUTPUT, file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        fresh = os.path.join(tmp, 'caffe.pb')
        generate(fresh)
        if not same_schema(committed, fresh):
            print('%s is out of date with %s; run: python tools/gen_proto.py'
                  % (OUTPUT, PROTO), file=sys.stderr)
            return 1
    print('%s is up to date' % OUTPUT)
    return 0


if __name__ == '__main__':
    sys.exit(main())
