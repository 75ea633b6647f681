"""Image data for the data layers: Caffe's Datum and LMDB, its DataTransformer, image lists,
segmentation pairs, and the functions behind tools/convert_imageset.py and
tools/compute_image_mean.py. OpenCV is imported only when images are read or written."""
from .datum import LMDBReader, array_to_datum, datum_to_array, encoded_datum, parse_datum
from .imageset import compute_image_mean, convert_imageset, read_image_list, write_mean_file
from .segmentation import SegTransformer, read_pair_list
from .transform import DataTransformer, load_mean_file

__all__ = ['DataTransformer', 'LMDBReader', 'SegTransformer', 'array_to_datum',
           'compute_image_mean', 'convert_imageset', 'datum_to_array', 'encoded_datum',
           'load_mean_file', 'parse_datum', 'read_image_list', 'read_pair_list',
           'write_mean_file']
