"""The files a train_val net's data layers read, written small with the package's own
writers, where their prototxt names them (relative paths: call inside the folder).

``write_sources(param, sample)`` gives every Data layer an LMDB of raw records of shape
``sample`` (C, H, W), every HDF5Data a list naming one .h5 file whose first top has rows
of shape ``sample`` (labels: one number a row), and every SegData, ImageSegData and
ImageData a list naming PNG images of ``sample``'s height and width.
"""
import os

import h5py
import numpy as np

from caffe_syncbn.data import array_to_datum, encoded_datum
from caffe_syncbn.data.datum import cv2, encode_image, write_lmdb
from caffe_syncbn.netparam.upgrade import load_net_param

ROWS = 2


def write_lmdb_of(path, sample, rows=ROWS, encode=None, seed=0):
    """An LMDB of ``rows`` records of shape ``sample``: raw uint8, or PNG files (encode='png')."""
    rs = np.random.RandomState(seed)
    records = []
    for i in range(rows):
        image = rs.randint(0, 256, sample).astype(np.uint8)
        if encode:
            hwc = image[0] if image.shape[0] == 1 else image.transpose(1, 2, 0)
            datum = encoded_datum(encode_image(np.ascontiguousarray(hwc), encode), i)
        else:
            datum = array_to_datum(image, i % 10)
        records.append((b'%08d' % i, datum.SerializeToString()))
    _parent(path)
    write_lmdb(path, [records])


def write_image(path, height, width, channels=3, seed=0):
    image = np.random.RandomState(seed).randint(0, 256, (height, width, channels)).astype(np.uint8)
    _parent(path)
    assert cv2().imwrite(path, image if channels > 1 else image[..., 0])


def write_sources(param, sample):
    param = load_net_param(param)
    for layer in param.layer:
        if layer.type == 'Data' and not os.path.exists(layer.data_param.source):
            write_lmdb_of(layer.data_param.source, sample)
        elif layer.type == 'HDF5Data':
            _write_hdf5(layer, sample)
        elif layer.type in ('SegData', 'ImageSegData', 'ImageData'):
            _write_image_list(layer, sample)


def _parent(path):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)


def _write_hdf5(layer, sample):
    source = layer.hdf5_data_param.source
    name = source + '.h5'
    _parent(name)
    with h5py.File(name, 'w') as f:
        f[layer.top[0]] = np.zeros((ROWS,) + tuple(sample), np.float32)
        for top in layer.top[1:]:
            f[top] = np.zeros(ROWS, np.float32)
    with open(source, 'w') as f:
        f.write(name + '\n')


def _write_image_list(layer, sample):
    if layer.type == 'SegData':
        source, prefix = layer.seg_data_param.source, layer.seg_data_param.root_dir
    else:
        source, prefix = layer.image_data_param.source, layer.image_data_param.root_folder
    _, height, width = sample
    sep = '/' if prefix and not prefix.endswith('/') else ''
    write_image(prefix + sep + 'image.png', height, width)
    if layer.type == 'ImageData':
        text = sep + 'image.png 0\n'
    else:
        write_image(prefix + sep + 'labels.png', height, width, channels=1)
        text = '%simage.png %slabels.png\n' % (sep, sep)
    _parent(source)
    with open(source, 'w') as f:
        f.write(text)
