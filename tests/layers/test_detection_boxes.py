"""Boxes past the float range (layers/boxes.py): a net that is not trained yet can predict
log-sizes whose exp overflows (the detection example's SyncBN run after 3 iterations
predicts offsets near 9500). Decoded (in float64, on both engines) they are infinite
boxes, and NMS acts on the IEEE values as the fork and the CUDA kernels do (an infinite
box that overlaps another over an infinite width has overlap NaN, and is suppressed);
a coordinate past the top's type is +-inf there. No step overflows on the way.
"""
import warnings

import numpy as np
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2
from caffe_syncbn.layers.detection.boxes import box_sizes, overlap_matrix, overlaps
from caffe_syncbn.testing import build_layer

INF = np.inf


def detections(loc, dtype=np.float32):
    param = text_format.Parse(
        'name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "priors" '
        'top: "out" detection_output_param { num_classes: 2 nms_param { nms_threshold: 0.45 } '
        'code_type: CENTER_SIZE variance_encoded_in_target: true }', caffe_pb2.LayerParameter())
    priors = np.array([[0.1, 0.1, 0.3, 0.3, 0.2, 0.2, 0.4, 0.4, 0.6, 0.6, 0.8, 0.8],
                       [1] * 12], dtype).reshape(1, 2, 12)
    conf = np.array([[0.1, 0.9, 0.2, 0.8, 0.3, 0.7]], dtype)
    layer, bottom, top = build_layer(param, [np.reshape(loc, (1, 12)), conf, priors],
                                     dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter('error')          # an overflow would be a RuntimeWarning
        layer.forward(bottom, top)
    return top[0].data[0, 0]


def test_log_sizes_past_the_float_range_decode_to_infinite_boxes():
    """Priors 0 and 1 get widths e^800 and e^900: infinite. Box 1 overlaps box 0 over an
    infinite width: overlap NaN, suppressed. Prior 2 keeps its own box."""
    rows = detections([0, 0, 800, 0, 0, 0, 900, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(rows, [[0, 1, 0.9, -INF, 0.1, INF, 0.3],
                                      [0, 1, 0.7, 0.6, 0.6, 0.8, 0.8]], rtol=1e-6)


def test_boxes_past_the_tops_type_are_infinite_there():
    """e^200 and e^300 are finite in float64: box 1 overlaps box 0 by e^-100 and stays.
    A float32 top holds their x coordinates as -inf and inf; a float64 one as they are."""
    loc = [0, 0, 200, 0, 0, 0, 300, 0, 0, 0, 800, -800]
    rows = detections(loc)
    np.testing.assert_allclose(rows, [[0, 1, 0.9, -INF, 0.1, INF, 0.3],
                                      [0, 1, 0.8, -INF, 0.2, INF, 0.4],
                                      [0, 1, 0.7, -INF, 0.7, INF, 0.7]], rtol=1e-6)
    rows = detections(loc, np.float64)
    np.testing.assert_allclose(rows[:2, 3], [-np.exp(200) * 0.1, -np.exp(300) * 0.1])
    assert list(rows[2, 3:]) == [-INF, 0.7, INF, 0.7]          # e^-800 is 0: no height


def test_sizes_and_overlaps_of_infinite_boxes_are_the_ieee_values():
    wide = np.array([-INF, 0.0, INF, 1.0])
    flat = np.array([-INF, 0.5, INF, 0.5])                      # inf x 0
    unit = np.array([0.0, 0.0, 1.0, 1.0])
    huge = np.array([0.0, 0.0, 1e200, 1e200])                   # its area is past the range
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        sizes = box_sizes(np.stack([wide, flat, unit, huge]))
        assert sizes[0] == INF and np.isnan(sizes[1]) and sizes[2] == 1 and sizes[3] == INF
        one = overlaps(wide, np.stack([wide, unit, huge]))
        matrix = overlap_matrix(np.stack([wide, unit]), np.stack([wide, unit, huge]))
    # an infinite intersection gives inf - inf: NaN; a finite one over an infinite union 0
    assert np.isnan(one[0]) and one[1] == 0 and one[2] == 0
    np.testing.assert_array_equal(np.isnan(matrix), [[True, False, False], [False] * 3])
    np.testing.assert_array_equal(matrix[:, 1:], [[0, 0], [1, 0]])
