"""The model converter's command line (tools/convert_model.py).

    convert_model.py to-syncbn    --model IN.prototxt [--weights IN.caffemodel] --output OUT
    convert_model.py to-batchnorm --model IN.prototxt [--weights IN.caffemodel] --output OUT
    convert_model.py fold-bn      --model IN.prototxt  --weights IN.caffemodel  --output OUT
                                  [--input-shape N,C,H,W]
    convert_model.py to-deploy    --model IN.prototxt [--weights ...] --output OUT [--input-shape N,C,H,W]
    convert_model.py to-onnx      --model IN.prototxt [--weights ...] --output OUT [--input-shape N,C,H,W]
                                  [--opset K] [--dynamic-batch] [--outputs A,B]

Caffe outputs are OUT.prototxt, and OUT.caffemodel when weights are given (OUT.caffemodel.h5
with --hdf5); ONNX output is OUT.onnx. Every file is written atomically.
"""
import argparse
import logging
import os

from google.protobuf import text_format

from ..convert import fold_bn, to_batchnorm, to_deploy, to_syncbn
from ..errors import CaffeError
from ..export import to_onnx
from ..formats.atomic import atomic_write
from ..formats.caffemodel import Record, write_records, write_records_hdf5
from ..formats.regular import require_regular
from ..netparam.graph import shared_param_owners
from ..netparam.upgrade import load_net_param

log = logging.getLogger('caffe_syncbn')

COMMANDS = ('to-syncbn', 'to-batchnorm', 'fold-bn', 'to-deploy', 'to-onnx')
_SUFFIXES = ('.prototxt', '.caffemodel.h5', '.caffemodel', '.onnx')


def parse_shape(text):
    try:
        shape = tuple(int(v) for v in text.replace('x', ',').split(','))
    except ValueError:
        shape = ()
    if len(shape) < 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError('expected positive sizes like 1,3,224,224, got %r' % text)
    return shape


def build_parser(prog=None):
    p = argparse.ArgumentParser(prog=prog, description='Convert a Caffe model: batch-norm forms, '
                                'BN folding, deploy nets and ONNX.')
    p.add_argument('command', choices=COMMANDS)
    p.add_argument('--model', required=True, metavar='FILE', help='the net prototxt')
    p.add_argument('--weights', metavar='FILE',
                   help='its caffemodel (binary or HDF5); fold-bn needs it')
    p.add_argument('--output', required=True, metavar='OUT',
                   help='output prefix: OUT.prototxt, OUT.caffemodel, OUT.onnx')
    p.add_argument('--input-shape', type=parse_shape, metavar='SHAPE',
                   help="N,C,H,W of the data input (to-deploy, fold-bn, to-onnx; default: the "
                        "prototxt's Input shapes, or what its data layers' sources give)")
    p.add_argument('--opset', type=int, default=17, metavar='K',
                   help='ONNX opset (to-onnx; default 17)')
    p.add_argument('--outputs', type=lambda text: [n for n in text.split(',') if n],
                   metavar='A,B',
                   help="the blobs the ONNX model gives, separated by ',' (to-onnx; default: "
                        "the net's outputs): it leaves out the layers none of them needs")
    p.add_argument('--dynamic-batch', action='store_true',
                   help='ONNX inputs and outputs take any batch size')
    p.add_argument('--stage', action='append', default=[], metavar='S',
                   help='NetState stage for the TEST net (to-deploy; repeatable)')
    p.add_argument('--hdf5', action='store_true', help='write OUT.caffemodel.h5 instead')
    return p


def convert(command, model, weights=None, input_shape=None, stages=()):
    """(NetParameter, weights or None) of a Caffe-to-Caffe ``command``."""
    if command == 'to-syncbn':
        return to_syncbn(model, weights)
    if command == 'to-batchnorm':
        return to_batchnorm(model, weights)
    if command == 'fold-bn':
        if weights is None:
            raise CaffeError('fold-bn needs --weights: folding changes the weights')
        return fold_bn(model, weights, input_shape=input_shape)
    return to_deploy(model, weights, input_shape=input_shape, stages=stages)


def write_net(prefix, net_param, weights, hdf5=False):
    """OUT.prototxt (and OUT.caffemodel[.h5]); returns the paths written. The weights go
    first, the larger write and the likelier to fail, so that a failure leaves the previous
    pair as it was."""
    paths = [prefix + '.prototxt']
    if weights is not None:
        records = [Record(layer, weights.get(layer.name, []), None) for layer in net_param.layer]
        paths.append(prefix + ('.caffemodel.h5' if hdf5 else '.caffemodel'))
        if hdf5:      # as Caffe writes it: a shared param under its owner only
            write_records_hdf5(paths[1], records, set(shared_param_owners(net_param.layer)))
        else:
            write_records(paths[1], records, net_param.name)
    with atomic_write(paths[0]) as f:
        f.write(text_format.MessageToString(net_param).encode('utf-8'))
    return paths


def write_onnx(path, model, weights=None, input_shape=None, opset=17, dynamic_batch=False,
               outputs=None):
    """OUT.onnx of a deploy net; ``input_shape`` sizes its first input."""
    net_param = load_net_param(model)
    shapes = None
    if input_shape:
        inputs = [top for layer in net_param.layer if layer.type == 'Input' for top in layer.top]
        if not inputs:
            raise CaffeError('%s: --input-shape: the net has no Input layer (make it a deploy '
                             'net first: to-deploy)' % model)
        shapes = {inputs[0]: input_shape}
    onnx_model = to_onnx(net_param, weights, input_shapes=shapes, opset=opset,
                         dynamic_batch=dynamic_batch, outputs=outputs)
    with atomic_write(path) as f:
        f.write(onnx_model.SerializeToString())
    return path


def output_prefix(path):
    for suffix in _SUFFIXES:
        if path.endswith(suffix):
            return path[:-len(suffix)]
    return path


def main(argv=None, prog=None):
    args = build_parser(prog).parse_args(argv)
    for path in filter(None, [args.model, args.weights]):
        if not os.path.exists(path):
            raise CaffeError('%s: no such file' % path)
        require_regular(path)
    prefix = output_prefix(args.output)
    if args.command == 'to-onnx':
        written = [write_onnx(prefix + '.onnx', args.model, args.weights, args.input_shape,
                              args.opset, args.dynamic_batch, args.outputs)]
    else:
        net_param, weights = convert(args.command, args.model, args.weights, args.input_shape,
                                     args.stage)
        written = write_net(prefix, net_param, weights, args.hdf5)
    log.info('%s: wrote %s', args.command, ', '.join(written))
    return 0
