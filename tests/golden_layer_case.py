"""Replay a single-layer golden case on one layer built by ``build_layer``.

The case's net is Input (and maybe Parameter) layers feeding one layer under test; its
bottoms are the recorded ``data/<blob>`` arrays, so Parameter-fed cases work too.
"""
import json

import numpy as np
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2
from caffe_syncbn.layer import TEST, TRAIN
from caffe_syncbn.testing import build_layer
from conftest import GOLDEN, require

RTOL, ATOL = 1e-4, 1e-5
FEEDERS = {'Input', 'Parameter'}


def single_layer_cases(layer_types):
    """Names of golden cases whose only non-feeder layer has one of ``layer_types``."""
    index = GOLDEN / 'index.json'
    if not index.exists():
        return ['<no golden data>']
    names = []
    for case in json.loads(index.read_text())['cases']:
        kinds = set(case['layer_types']) - FEEDERS
        if case['kind'] == 'layer' and len(kinds) == 1 and kinds <= set(layer_types):
            names.append(case['name'])
    return names


def _close(actual, expected, what):
    assert actual.shape == expected.shape, '%s: shape %s, expected %s' % (
        what, actual.shape, expected.shape)
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL, err_msg=what)


def run_single_layer_case(name, monkeypatch, dtype=np.float32):
    require(GOLDEN / (name + '.npz'))
    monkeypatch.chdir(GOLDEN)          # file paths in prototxts are relative to the folder
    net = text_format.Parse((GOLDEN / (name + '.prototxt')).read_text(), caffe_pb2.NetParameter())
    (param,) = [lp for lp in net.layer if lp.type not in FEEDERS]
    ref = np.load(GOLDEN / (name + '.npz'))
    phase = TRAIN if str(ref['phase']) == 'TRAIN' else TEST
    layer, bottom, top = build_layer(param, [ref['data/' + b] for b in param.bottom],
                                     phase=phase, dtype=dtype)
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = ref['param_after/%s/%d' % (param.name, i)]
    layer.forward(bottom, top)
    for blob, top_name in zip(top, param.top):
        _close(blob.data, ref['data/' + top_name], 'data/' + top_name)
    if not any(k.startswith('diff/') for k in ref.files):
        return
    if layer.is_loss:       # the Net writes each top's loss weight into its diff
        weights = list(param.loss_weight) or [1.0] + [0.0] * (len(top) - 1)
        for blob, weight in zip(top, weights):
            blob.diff[...] = weight
    else:
        for blob, top_name in zip(top, param.top):
            blob.diff[...] = ref['topdiff/' + top_name]
    for blob in layer.blobs:
        blob.diff[...] = 0
    for blob in bottom:
        blob.diff[...] = 0
    layer.backward(top, [layer.allow_force_backward(i) for i in range(len(bottom))], bottom)
    for blob, bottom_name in zip(bottom, param.bottom):
        _close(blob.diff, ref['diff/' + bottom_name], 'diff/' + bottom_name)
    for i, blob in enumerate(layer.blobs):
        _close(blob.diff, ref['param_diff/%s/%d' % (param.name, i)], 'param_diff/%d' % i)

