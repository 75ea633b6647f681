"""Replay Caffe's golden outputs on one layer built by ``build_layer``, or by an engine of
helpers/engines.py: a single-layer case (Input, and maybe Parameter, layers feeding the one
layer under test; its bottoms are the recorded ``data/<blob>`` arrays, so Parameter-fed
cases work too), or one layer of a layer or net case on the blobs the net recorded.
"""
import json

import numpy as np
import pytest
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2
from caffe_syncbn.layer import TEST, TRAIN
from caffe_syncbn.testing import build_layer
from helpers.paths import GOLDEN, require

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


def run_single_layer_case(name, monkeypatch, dtype=np.float32, engine=None):
    require(GOLDEN / (name + '.npz'))
    build = build_layer if engine is None else engine.build
    xp = np if engine is None else engine.xp
    host = np.asarray if engine is None else engine.host
    monkeypatch.chdir(GOLDEN)          # file paths in prototxts are relative to the folder
    net = text_format.Parse((GOLDEN / (name + '.prototxt')).read_text(), caffe_pb2.NetParameter())
    (param,) = [lp for lp in net.layer if lp.type not in FEEDERS]
    ref = np.load(GOLDEN / (name + '.npz'))
    phase = TRAIN if str(ref['phase']) == 'TRAIN' else TEST
    layer, bottom, top = build(param, [ref['data/' + b] for b in param.bottom], phase=phase,
                               dtype=dtype)
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = xp.asarray(ref['param_after/%s/%d' % (param.name, i)].astype(dtype))
    layer.forward(bottom, top)
    for blob, top_name in zip(top, param.top):
        _close(host(blob.data), ref['data/' + top_name], 'data/' + top_name)
    if not any(k.startswith('diff/') for k in ref.files):
        return
    if layer.is_loss:       # the Net writes each top's loss weight into its diff
        weights = list(param.loss_weight) or [1.0] + [0.0] * (len(top) - 1)
        for blob, weight in zip(top, weights):
            blob.diff[...] = weight
    else:
        for blob, top_name in zip(top, param.top):
            blob.diff[...] = xp.asarray(ref['topdiff/' + top_name].astype(dtype))
    for blob in layer.blobs:
        blob.diff[...] = 0
    for blob in bottom:
        blob.diff[...] = 0
    layer.backward(top, [layer.allow_force_backward(i) for i in range(len(bottom))], bottom)
    for blob, bottom_name in zip(bottom, param.bottom):
        _close(host(blob.diff), ref['diff/' + bottom_name], 'diff/' + bottom_name)
    for i, blob in enumerate(layer.blobs):
        _close(host(blob.diff), ref['param_diff/%s/%d' % (param.name, i)], 'param_diff/%d' % i)


def _golden_index():
    if not (GOLDEN / 'index.json').exists():
        return {}
    return {c['name']: c for c in json.loads((GOLDEN / 'index.json').read_text())['cases']}


def _net_param(case):
    return text_format.Parse((GOLDEN / ('%s.prototxt' % case)).read_text(),
                             caffe_pb2.NetParameter())


def net_layer_cases(layer_types):
    """(case, layer name) for every layer of ``layer_types`` in a layer or net case."""
    types = set(layer_types)
    pairs = []
    for name, case in sorted(_golden_index().items()):
        if case['kind'] not in ('layer', 'net') or not types & set(case['layer_types']):
            continue
        pairs += [(name, lp.name) for lp in _net_param(name).layer if lp.type in types]
    return pairs or [('<no golden data>', None)]


def _close_reshaped(actual, expected, what):
    np.testing.assert_allclose(np.asarray(actual).reshape(np.shape(expected)), expected,
                               rtol=RTOL, atol=ATOL, err_msg=what)


def _blob_needs_backward(net, upto, npz):
    """Caffe's need-backward flags of the blobs just before layer ``upto`` runs."""
    need = {}
    for lp in net.layer:
        if lp.name == upto:
            return need
        count = sum(1 for k in npz.files if k.startswith('param_after/%s/' % lp.name))
        lr = [lp.param[j].lr_mult if j < len(lp.param) else 1.0 for j in range(count)]
        learns = lp.type != 'BatchNorm' and any(m != 0 for m in lr)
        layer_needs = learns or any(need.get(b, False) for b in lp.bottom)
        for t in lp.top:
            need[t] = layer_needs
    raise KeyError(upto)


def run_net_layer_case(case_name, layer_name, engine=None):
    """Run one layer of a golden case on the recorded blobs (on ``engine``, else by
    build_layer) and compare its outputs, bottom diffs and param diffs with Caffe's. Blobs
    rewritten by an in-place layer (whose recorded value is the last writer's) and blobs with
    several consumers (whose recorded diff is a sum) are left out of the comparison."""
    build = build_layer if engine is None else engine.build
    xp = np if engine is None else engine.xp
    host = np.asarray if engine is None else engine.host
    require(GOLDEN / 'index.json')
    case = _golden_index()[case_name]
    net = _net_param(case_name)
    lp = next(layer for layer in net.layer if layer.name == layer_name)
    npz = np.load(GOLDEN / ('%s.npz' % case_name))
    written_in_place = {t for layer in net.layer for t in layer.top if t in layer.bottom}
    if written_in_place & (set(lp.top) | set(lp.bottom)):
        pytest.skip('%s runs on in-place blobs; the whole-net runner checks it' % layer_name)
    phase = TRAIN if str(npz['phase']) == 'TRAIN' else TEST

    layer, bottom, top = build(lp, [npz['data/' + b] for b in lp.bottom], phase=phase,
                               dtype=np.float32)
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = xp.asarray(npz['param_after/%s/%d' % (layer_name, i)]
                                    .astype(np.float32).reshape(blob.shape))
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    for name, t in zip(lp.top, top):
        _close_reshaped(host(t.data), npz['data/' + name], '%s: top %s' % (case_name, name))
    if not case['backward']:
        return

    need = _blob_needs_backward(net, layer_name, npz)
    propagate_down = [need.get(b, False) or (net.force_backward and layer.allow_force_backward(i))
                      for i, b in enumerate(lp.bottom)]
    for name, t in zip(lp.top, top):
        t.diff[...] = xp.asarray(npz['diff/' + name].astype(np.float32).reshape(t.shape))
    lr = [lp.param[j].lr_mult if j < len(lp.param) else 1.0 for j in range(len(layer.blobs))]
    layer.param_propagate_down = [m != 0 for m in lr]
    for blob in layer.blobs:
        blob.diff[...] = 0
    layer.backward(top, propagate_down, bottom)
    consumers = [b for layer in net.layer for b in layer.bottom]
    for name, b, down in zip(lp.bottom, bottom, propagate_down):
        if down and consumers.count(name) == 1:
            _close_reshaped(host(b.diff), npz['diff/' + name],
                            '%s: diff of bottom %s' % (case_name, name))
    for i, blob in enumerate(layer.blobs):
        if layer.param_propagate_down[i]:
            _close_reshaped(host(blob.diff), npz['param_diff/%s/%d' % (layer_name, i)],
                            '%s: param diff %s/%d' % (case_name, layer_name, i))
