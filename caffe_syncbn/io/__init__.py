"""Files on disk: weights (.caffemodel, HDF5), .binaryproto blobs, atomic writes.

pycaffe's ``caffe.io`` names (blobproto_to_array, Transformer, load_image, ...) are
here too, from caffe_syncbn.pycaffe.io.
"""


PYCAFFE_NAMES = ('Transformer', 'load_image', 'resize_image', 'oversample', 'blobproto_to_array',
                 'array_to_blobproto', 'arraylist_to_blobprotovector_str',
                 'blobprotovector_str_to_arraylist', 'array_to_datum', 'datum_to_array')


def __getattr__(name):
    if name not in PYCAFFE_NAMES:
        raise AttributeError("module 'caffe_syncbn.io' has no attribute %r" % name)
    from ..pycaffe import io as pycaffe_io
    return getattr(pycaffe_io, name)
