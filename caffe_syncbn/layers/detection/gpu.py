"""The detection layers' passes over every prior on the GPU (cuda/detection.cu): box decoding
and the Jaccard overlap matrix, for DetectionOutput, DetectionEvaluate and MultiBoxLoss.

The engine's two functions, with boxes.py's host engine's signatures: arrays of the layer's
array module in, arrays of that module out, in acc_t of the input type (float32 for float16
and float32, float64 for float64). NMS and the matching loop stay on the host (why:
cuda/detection.cu's header).
"""
import numpy as np

from ...backend import cuda_kernels, get_array_module
from ...backend.launch import BLOCK, contiguous, grid_1d, i32, i64


def _acc_dtype(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def decode_all(loc, prior_data, code_type, variance_encoded_in_target):
    """Boxes (num, P, L, 4) that offsets ``loc`` (num, P, L, 4) predict from ``prior_data``
    (2, P, 4): PriorBox's boxes and variances."""
    xp = get_array_module(loc)
    num, priors, loc_classes = loc.shape[:3]
    loc = contiguous(xp, loc)
    prior_data = contiguous(xp, prior_data.astype(loc.dtype, copy=False))
    boxes = xp.empty(loc.shape, _acc_dtype(loc.dtype))
    if boxes.size:
        cuda_kernels.typed_kernel('detection', 'decode_boxes', loc.dtype)(
            grid_1d(num * priors * loc_classes), (BLOCK,),
            (loc, prior_data, i32(num), i32(priors), i32(loc_classes), i32(code_type),
             i32(bool(variance_encoded_in_target)), boxes))
    return boxes


def overlap_matrix(boxes, others):
    """Jaccard overlaps (len(boxes), len(others)) of two sets of (xmin, ymin, xmax, ymax) rows;
    ``others`` may be a host array (ground truth read from the label blob)."""
    xp = get_array_module(boxes)
    dtype = np.result_type(boxes.dtype, others.dtype)
    a = contiguous(xp, xp.asarray(boxes, dtype))
    b = contiguous(xp, xp.asarray(others, dtype))
    iou = xp.empty((len(a), len(b)), _acc_dtype(dtype))
    if iou.size:
        cuda_kernels.typed_kernel('detection', 'jaccard', dtype)(
            grid_1d(iou.size), (BLOCK,), (a, i64(len(a)), b, i64(len(b)), iou))
    return iou
