"""Real-world nets of shared/corpus: each builds in TRAIN and TEST once its data layers are
Input layers, with BVLC Caffe's blob and param shapes where caffe_shapes.json has them; the
PSPNet and FCN-8s deploy nets run forward with random weights."""
import json

import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn.netparam.inputs import swap_data_layers_for_inputs
from caffe_syncbn.netparam.upgrade import load_net_param

from helpers.paths import CORPUS, GOLDEN, require

PSPNET = 'hszhao_PSPNet__evaluation_prototxt_pspnet50_ADE20K_473.prototxt'
FCN8S = 'shelhamer_fcn.berkeleyvision.org__voc-fcn8s_deploy.prototxt'
PHASES = {'TRAIN': caffe.TRAIN, 'TEST': caffe.TEST}


def corpus_nets():
    if not CORPUS.exists():
        return ['<no corpus>']
    return sorted(p.name for p in CORPUS.glob('*.prototxt') if 'solver' not in p.name)


def caffe_shapes():
    path = CORPUS / 'caffe_shapes.json'
    return json.loads(path.read_text()) if path.exists() else {}


def stage_sets(param, phase):
    """The stage lists to build ``phase`` with: one per stage that the phase's include rules
    name (the autoencoder's TEST data layers exist only under 'test-on-train'/'test-on-test',
    which its solver sets), else just no stage."""
    stages = sorted({s for layer in param.layer for rule in layer.include
                     if not rule.HasField('phase') or rule.phase == phase for s in rule.stage})
    return [[s] for s in stages] or [[]]


def input_tops(param):
    return [top for layer in param.layer if layer.type == 'Input' for top in layer.top]


def build(name, phase, shapes=None, stages=()):
    param = swap_data_layers_for_inputs(load_net_param(CORPUS / name), shapes=shapes)
    return caffe.Net(param, phase, stages=stages)


@pytest.mark.parametrize('phase', sorted(PHASES))
@pytest.mark.parametrize('name', corpus_nets())
def test_corpus_net_builds(name, phase):
    require(CORPUS / name)
    recorded = caffe_shapes().get(name, {}).get(phase)
    param = load_net_param(CORPUS / name)
    shapes = None
    if recorded is not None:
        shapes = {top: recorded['blobs'][top] for top in input_tops(swap_data_layers_for_inputs(param))}
    for stages in stage_sets(param, PHASES[phase]):
        net = build(name, PHASES[phase], shapes, stages)
        assert net.layers and all(len(blob.shape) or blob.count == 1 for blob in net.blobs.values())
        if recorded is None:
            continue
        assert {k: list(b.shape) for k, b in net.blobs.items()} == recorded['blobs']
        assert {k: [list(b.shape) for b in blobs] for k, blobs in net.params.items()} == \
            {k: v for k, v in recorded['params'].items() if v}
        assert [layer.type for layer in net.layers] == recorded['layers']


def test_pspnet_shapes_match_the_fork():
    blobs_path = require(GOLDEN / 'psp_shapes_pspnet50_ADE20K_473.json')
    params_path = require(GOLDEN / 'psp_shapes_pspnet50_ADE20K_473_params.json')
    require(CORPUS / PSPNET)
    blobs, params = json.loads(blobs_path.read_text()), json.loads(params_path.read_text())
    net = build(PSPNET, caffe.TEST, shapes={'data': blobs['data']})
    assert [(k, list(b.shape)) for k, b in net.blobs.items()] == list(blobs.items())
    assert [(k, [list(b.shape) for b in v]) for k, v in net.params.items()] == \
        [(k, v) for k, v in params.items() if v]


def random_weights(net, seed=0):
    """Weights that keep activations in range: fan-in scaled normals, sane BN statistics."""
    rs = np.random.RandomState(seed)
    for layer in net.layers:
        blobs = layer.blobs
        if layer.type == 'BN':                 # slope, bias, running mean, running var
            values = [1 + 0.1 * rs.standard_normal(b.shape) if i == 0 else
                      rs.uniform(0.5, 1.5, b.shape) if i == 3 else 0.1 * rs.standard_normal(b.shape)
                      for i, b in enumerate(blobs)]
        elif layer.type == 'BatchNorm':        # mean sum, variance sum, scale factor
            values = [0.1 * rs.standard_normal(blobs[0].shape), rs.uniform(0.5, 1.5, blobs[1].shape),
                      np.ones(blobs[2].shape)]
        else:
            values = [rs.standard_normal(b.shape) / np.sqrt(max(1, np.prod(b.shape[1:])))
                      for b in blobs]
        for blob, value in zip(blobs, values):
            blob.data[...] = value


@pytest.mark.slow
@pytest.mark.parametrize('name, output', [(PSPNET, 'conv6_interp'), (FCN8S, 'score')])
def test_deploy_net_forward_at_batch_1(name, output):
    require(CORPUS / name)
    net = build(name, caffe.TEST)
    random_weights(net)
    shape = net.blobs['data'].shape
    assert shape[0] == 1
    expected = {PSPNET: (1, 150, 473, 473), FCN8S: (1, 21, 500, 500)}[name]
    x = np.random.RandomState(1).uniform(-1, 1, shape).astype(np.float32)
    out = net.forward(data=x)
    assert list(out) == [output] and out[output].shape == expected
    assert np.all(np.isfinite(out[output])) and np.any(out[output] != 0)
