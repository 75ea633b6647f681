"""pycaffe's ``caffe.proto`` package: ``from caffe.proto import caffe_pb2``."""
from .. import caffe_pb2  # noqa: F401

__all__ = ['caffe_pb2']
