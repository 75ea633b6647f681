"""``install_as_caffe()``: scripts written for pycaffe run unchanged after this one call."""
import sys

from ..errors import CaffeError


def install_as_caffe():
    """Make ``import caffe`` give caffe_syncbn's pycaffe module, with its submodules
    (caffe.io, caffe.proto.caffe_pb2, caffe.draw, caffe.coord_map, caffe.net_spec,
    caffe.classifier, caffe.detector). Returns that module. Python layers that
    ``import caffe`` get it too. Call it before anything imports another ``caffe``."""
    from .. import caffe_pb2, netspec
    from . import caffe, classifier, coord_map, detector, draw, io, proto
    present = sys.modules.get('caffe')
    if present is not None and present is not caffe:
        raise CaffeError('install_as_caffe(): another module named caffe is already imported (%s); '
                         'call install_as_caffe() before anything imports caffe'
                         % getattr(present, '__file__', present))
    sys.modules.update({
        'caffe': caffe, 'caffe.pycaffe': caffe, 'caffe.io': io, 'caffe.proto': proto,
        'caffe.proto.caffe_pb2': caffe_pb2, 'caffe.draw': draw, 'caffe.coord_map': coord_map,
        'caffe.net_spec': netspec, 'caffe.classifier': classifier, 'caffe.detector': detector})
    return caffe
