"""Real prototxts of NVCaffe, R-FCN and other forks (tests/fork_corpus; where each comes
from, at which commit, in its SOURCES.tsv): each builds once its data layers are Input
layers, and runs forward in TEST and TRAIN at batch 1 with weights that keep activations in
range."""
import re

import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn.netparam.inputs import swap_data_layers_for_inputs
from caffe_syncbn.netparam.upgrade import load_net_param
from helpers.paths import ROOT
from test_corpus import random_weights

FOLDER = ROOT / 'tests' / 'fork_corpus'
PHASES = {'TRAIN': caffe.TRAIN, 'TEST': caffe.TEST}

#: TEST outputs (name: shape) of the nets whose outputs say most about their forks' layers
TEST_OUTPUTS = {
    'daijifeng001_R-FCN__models_rfcn_prototxts_ResNet-50L_res3a_test.prototxt':
        {'cls_prob': (3, 21, 1, 1), 'bbox_pred': (3, 8, 1, 1)},
    'rbgirshick_py-faster-rcnn__models_pascal_voc_ZF_fast_rcnn_test.prototxt':
        {'cls_prob': (3, 21), 'bbox_pred': (3, 84)},
    'chuanqi305_MobileNetv2-SSDLite__ssdlite_voc_deploy.prototxt':
        {'detection_out': (1, 1, 100, 7)},
    'shicai_DenseNet-Caffe__DenseNet_121.prototxt': {'fc6': (1, 1000, 1, 1)},
}


#: this module's nets: NVCaffe's, R-FCN's, py-faster-rcnn's, chuanqi305's and a converted
#: DenseNet (the other forks' have test_fork_corpus.py and test_fork_corpus_*.py)
NETS = ('daijifeng001_R-FCN__models_rfcn_prototxts_ResNet-50L_res3a_test.prototxt',
        'chuanqi305_MobileNetv2-SSDLite__ssdlite_voc_deploy.prototxt',
        'NVIDIA_caffe__models_resnet18_train_val.prototxt',
        'rbgirshick_py-faster-rcnn__models_pascal_voc_ZF_fast_rcnn_test.prototxt',
        'shicai_DenseNet-Caffe__DenseNet_121.prototxt')


def corpus_nets():
    return sorted(p.name for p in FOLDER.glob('*.prototxt'))


def sources():
    lines = (FOLDER / 'SOURCES.tsv').read_text().splitlines()
    return dict(line.split('\t') for line in lines if line.strip())


def test_every_prototxt_names_its_source():
    listed = sources()
    assert sorted(listed) == corpus_nets()
    for name, url in listed.items():
        match = re.fullmatch(r'https://github\.com/([\w.-]+)/([\w.-]+)/blob/[0-9a-f]{40}/(.+)',
                             url)
        assert match, url
        owner, repo, path = match.groups()
        assert name == '%s_%s__%s' % (owner, repo, path.replace('/', '_')), name


def inputs_of(net, rng):
    """Random inputs; ROIs (batch index, x1, y1, x2, y2) three boxes inside the image."""
    feeds = {}
    for name in net.inputs:
        shape = net.blobs[name].shape
        if name == 'rois':
            height, width = net.blobs['data'].shape[2:]
            boxes = [[0, 0, 0, width - 1, height - 1], [0, 10, 20, 120, 90],
                     [0, width / 2, height / 3, width - 5.5, height - 2.5]]
            net.blobs[name].reshape((3,) + tuple(shape[1:]))
            feeds[name] = np.array(boxes, np.float32).reshape((3,) + tuple(shape[1:]))
        else:
            feeds[name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize('phase', sorted(PHASES))
@pytest.mark.parametrize('name', sorted(NETS))
def test_fork_net_runs_forward(name, phase):
    param = swap_data_layers_for_inputs(load_net_param(FOLDER / name), batch=1)
    net = caffe.Net(param, PHASES[phase])
    random_weights(net)
    out = net.forward(**inputs_of(net, np.random.default_rng(0)))
    assert out
    for blob, values in out.items():
        assert np.all(np.isfinite(values)), blob
    if phase == 'TEST' and name in TEST_OUTPUTS:
        assert {k: v.shape for k, v in out.items()} == TEST_OUTPUTS[name]
