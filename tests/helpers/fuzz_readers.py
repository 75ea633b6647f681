"""The fuzz worker: a child process that runs one reader of the package per request.

    python tests/helpers/fuzz_readers.py MEMORY_LIMIT_BYTES

reads one JSON request a line on stdin, ``{"reader": name, "args": {...}, "cwd": folder}``,
and answers one JSON line on the file descriptor that was its stdout (fd 1 then points at
stderr, so that nothing a library prints can garble the answers):

    {"outcome": "accepted" | "CaffeError" | "leak", "type": exception class name,
     "message": str, "warnings": [log lines], "info": [log lines], "traceback": str}

The memory limit is set here, in the child, with resource.setrlimit (RLIMIT_DATA, which
counts the heap and anonymous maps but not LMDB's file map, as a real data set's map may
be a terabyte). A crash (a signal) or a hang is seen by the parent (tests/helpers/fuzz_harness.py).
"""
import json
import logging
import os
import resource
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

READERS = {}


def reader(function):
    READERS[function.__name__] = function
    return function


@reader
def net(args):
    """Build a net from a prototxt (setup and reshape of every layer), optionally run it
    forward (and backward)."""
    import caffe_syncbn as caffe
    net = caffe.Net(args['model'], caffe.TRAIN if args.get('phase') == 'TRAIN' else caffe.TEST,
                    weights=args.get('weights'))
    for _ in range(args.get('forwards', 0)):
        net.forward()
        if args.get('backward'):
            net.backward()


@reader
def net_param(args):
    """Parse, upgrade and filter a prototxt, and insert its splits (no layer is built)."""
    from caffe_syncbn import caffe_pb2
    from caffe_syncbn.netparam.graph import filter_net, insert_splits
    from caffe_syncbn.netparam.upgrade import load_net_param
    param = load_net_param(args['model'])
    for phase in (caffe_pb2.TRAIN, caffe_pb2.TEST):
        insert_splits(filter_net(param, caffe_pb2.NetState(phase=phase)))


@reader
def solver(args):
    """Build a solver from its prototxt, restore a solverstate if given, train steps."""
    from caffe_syncbn.pycaffe.caffe import get_solver
    solver = get_solver(args['solver'])
    if args.get('state'):
        solver.restore(args['state'])
    solver.step(args.get('steps', 1))


@reader
def weights(args):
    """A weights file (binary or HDF5), read as Net.copy_from reads it."""
    from caffe_syncbn.formats.caffemodel import read_weights
    read_weights(args['path'])


@reader
def solver_state(args):
    """A .solverstate or .solverstate.h5, read as Solver.restore reads it."""
    from caffe_syncbn.formats.solverstate import read_solver_state
    read_solver_state(args['path'])


@reader
def mean_file(args):
    """A .binaryproto mean image, as transform_param.mean_file reads it."""
    from caffe_syncbn.data.transform import load_mean_file
    load_mean_file(args['path'])


@reader
def datum(args):
    """One serialized Datum record, decoded as the Data layer decodes it."""
    from caffe_syncbn.data.datum import datum_to_array, parse_datum
    with open(args['path'], 'rb') as f:
        raw = f.read()
    datum_to_array(parse_datum(raw, args['path']), args.get('color'), args['path'])


@reader
def image_mean(args):
    """compute_image_mean over every record of an LMDB."""
    from caffe_syncbn.data.imageset import compute_image_mean
    compute_image_mean(args['path'], log=lambda line: None)


def main():
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    answers = os.fdopen(os.dup(1), 'w')
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append('%s %s' % (record.levelname, record.getMessage()))
    logger = logging.getLogger('caffe_syncbn')
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    from caffe_syncbn.errors import CaffeError
    for line in sys.stdin:
        request = json.loads(line)
        del records[:]
        os.chdir(request.get('cwd') or ROOT)
        answer = {'outcome': 'accepted'}
        try:
            READERS[request['reader']](request['args'])
        except CaffeError as exc:
            answer = {'outcome': 'CaffeError', 'type': type(exc).__name__, 'message': str(exc)}
        except BaseException as exc:        # what the suite is looking for: a leak
            answer = {'outcome': 'leak', 'type': type(exc).__name__,
                      'message': str(exc)[:2000], 'traceback': traceback.format_exc()[-4000:]}
        answer['warnings'] = [r for r in records if not r.startswith('INFO')]
        answer['info'] = [r for r in records if r.startswith('INFO')][:50]
        answers.write(json.dumps(answer) + '\n')
        answers.flush()


if __name__ == '__main__':
    main()
