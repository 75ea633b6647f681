"""Blobs in MATLAB .mat files, as DeepLab's MatWrite and MatRead keep them (matio_io.cpp).

A file holds the variable ``data``: a blob (N, C, H, W) as a MATLAB array W x H x C x N,
which is the blob's own bytes read in MATLAB's column-major order, of class single for
float32 blobs and double for float64 ones. The files are MATLAB level 5, which scipy.io
writes and reads (scipy.io.loadmat(f)['data'] is the W x H x C x N array). A file is
written atomically (formats/atomic.py).
"""
from ..errors import CaffeError, quote
from .atomic import atomic_write
from .regular import require_regular


def write_blob_mat(path, array):
    """Write the N x C x H x W (or fewer axes, padded with 1s in front) ``array``."""
    import scipy.io
    while array.ndim < 4:
        array = array[None]
    with atomic_write(path) as f:
        scipy.io.savemat(f, {'data': array.transpose(3, 2, 1, 0)}, format='5')


def read_blob_mat(path, error=CaffeError):
    """The blob (N, C, H, W) of a .mat file's ``data`` (single or double, at most 4 axes)."""
    import scipy.io
    require_regular(path, '.mat file', error)
    try:
        variables = scipy.io.loadmat(path, variable_names=['data'])
    except Exception as exc:          # scipy's readers raise several kinds on a bad file
        raise error('cannot read .mat file %s: %s' % (quote(path), exc)) from None
    if 'data' not in variables:
        raise error(".mat file %s holds no variable 'data'" % quote(path))
    data = variables['data']
    if data.dtype.kind != 'f' or data.ndim > 4:
        raise error(".mat file %s: 'data' must be single or double with at most 4 axes, got "
                    '%s of shape %s' % (quote(path), data.dtype, list(data.shape)))
    dims = tuple(data.shape) + (1,) * (4 - data.ndim)
    return data.reshape(dims, order='F').transpose(3, 2, 1, 0)
