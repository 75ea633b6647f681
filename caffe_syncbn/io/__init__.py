"""Files on disk: weights (.caffemodel, HDF5), .binaryproto blobs, atomic writes.

``blobproto_to_array`` and ``array_to_blobproto`` keep pycaffe's ``caffe.io`` names.
"""
from .caffemodel import array_to_blob as array_to_blobproto  # noqa: F401
from .caffemodel import blob_to_array as blobproto_to_array  # noqa: F401
