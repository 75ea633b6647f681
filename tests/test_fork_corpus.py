"""Real public prototxts of the segmentation forks (tests/fork_corpus, sources in its
SOURCES.tsv): each parses, builds in TRAIN and TEST with its data layers swapped for Input layers, and
runs forward with random weights (fan-in scaled, batch norms given statistics from their
input) to finite outputs that are not constant. Inputs are small where the net allows;
nets that fix their sizes (SegNet's Upsample with upsample_h/upsample_w) run at them."""
import os
import pathlib
import re

import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.convert import to_deploy
from caffe_syncbn.netparam.inputs import is_data_layer, swap_data_layers_for_inputs
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.netparam.upgrade import load_net_param
from helpers.model_weights import calibrate, random_weights

scipy_io = pytest.importorskip('scipy.io')

FORK_CORPUS = pathlib.Path(__file__).parent / 'fork_corpus'

SEGNET_BASIC = {'data': (1, 3, 40, 48), 'label': (1, 1, 40, 48)}   # its pad_out_h needs H/8 odd
SEGNET_FULL = {'data': (1, 3, 360, 480), 'label': (1, 1, 360, 480)}
DEEPLAB_VGG = {'data': (1, 3, 65, 65), 'label': (1, 1, 65, 65), 'data_dim': (1, 1, 1, 2)}

#: the input shapes of each net, by a part of its file name
SHAPES = {
    'Models_segnet_basic_': SEGNET_BASIC,
    'Models_bayesian_segnet_basic_': SEGNET_BASIC,
    'Models_segnet_train': SEGNET_FULL,
    'segnet_model_driving_webdemo': SEGNET_FULL,
    'enet_deploy_final': {'data': (1, 3, 64, 128)},
    'deeplab-public-ver2__exper_voc12_config_vgg16': DEEPLAB_VGG,
    'tensorflow-deeplab-resnet__misc_deploy': {'data': (1, 3, 65, 65)},
}
#: nets whose forward takes long on a loaded 2-core host (a VGG-16 SegNet at 360 x 480)
SLOW = ('Models_segnet_train', 'segnet_model_driving_webdemo')


#: DeepLab's configs are templates that its run_pascal.sh fills with sed (exper/sub.sed):
#: the values of its PASCAL VOC 2012 run
DEEPLAB_VALUES = {'NUM_LABELS': '21', 'EXP': 'voc12', 'NET_ID': 'vgg16', 'DATA_ROOT': 'voc12/data',
                  'TRAIN_SET': 'train_aug', 'TEST_SET': 'val', 'FEATURE_DIR': 'voc12/features'}


def fork_nets():
    """The segmentation forks' nets (the other forks' have test_fork_corpus_*.py)."""
    return sorted(p.name for p in FORK_CORPUS.glob('*.prototxt')
                  if any(part in p.name for part in SHAPES))


def shapes_of(name):
    found = [shapes for part, shapes in SHAPES.items() if part in name]
    assert len(found) == 1, '%s: give its input shapes in SHAPES' % name
    return found[0]


def net_param(name):
    text = (FORK_CORPUS / name).read_text()
    if '${' not in text:
        return load_net_param(FORK_CORPUS / name)
    text = re.sub(r'\$\{(\w+)\}', lambda m: DEEPLAB_VALUES[m.group(1)], text)
    return load_net_param(parse_text(text, caffe_pb2.NetParameter(), name))


def build(name, phase):
    param = swap_data_layers_for_inputs(net_param(name), shapes=shapes_of(name))
    return caffe.Net(param, phase)


def phases_of(name):
    """The phases the net has its data in: those its data layers' include rules name."""
    named = {rule.phase for layer in net_param(name).layer if is_data_layer(layer)
             for rule in layer.include if rule.HasField('phase')}
    return sorted(named) or [caffe.TRAIN, caffe.TEST]


def net_files(tmp_path, param):
    """The lists MatWrite layers read, with a few names, and the folders they write to,
    under ``tmp_path`` (the current folder)."""
    for layer in param.layer:
        if layer.type == 'MatWrite':
            p = layer.mat_write_param
            os.makedirs(os.path.dirname(p.source), exist_ok=True)
            with open(p.source, 'w') as f:
                f.write('2007_000033\n2007_000042\n')
            os.makedirs(p.prefix, exist_ok=True)


def test_every_file_has_its_source():
    listed = {line.split('\t')[0] for line in
              (FORK_CORPUS / 'SOURCES.tsv').read_text().splitlines() if line.strip()}
    assert listed == {p.name for p in FORK_CORPUS.glob('*.prototxt')}
    for line in (FORK_CORPUS / 'SOURCES.tsv').read_text().splitlines():
        name, url = line.split('\t')
        assert url.startswith('https://github.com/') and '/blob/' in url, line


@pytest.mark.parametrize('name', fork_nets())
def test_fork_net_builds(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    net_files(tmp_path, net_param(name))
    for phase in phases_of(name):
        net = build(name, phase)
        for top, shape in shapes_of(name).items():
            if top in net.blobs:
                assert net.blobs[top].shape == shape


@pytest.mark.parametrize('name', [pytest.param(n, marks=pytest.mark.slow)
                                  if any(s in n for s in SLOW) else n for n in fork_nets()])
def test_fork_net_runs_forward(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    net_files(tmp_path, net_param(name))
    net = build(name, phases_of(name)[-1])
    rng = np.random.default_rng(0)
    inputs = {'data': rng.uniform(-100, 100, shapes_of(name)['data']),
              'label': rng.integers(0, 2, shapes_of(name).get('label', (1,))),
              'data_dim': np.reshape(shapes_of(name)['data'][2:], (1, 1, 1, 2))}
    for top, value in inputs.items():
        if top in net.blobs:
            net.blobs[top].data[...] = value
    weights = random_weights(net, rng)
    calibrate(net, weights, rng)
    outputs = net.forward()
    for layer in net.net_param.layer:         # DeepLab's test nets write their scores
        if layer.type == 'MatWrite':
            path = layer.mat_write_param.prefix + '2007_000033_blob_0.mat'
            written = scipy_io.loadmat(path)['data'].transpose(3, 2, 1, 0)
            np.testing.assert_array_equal(written, net.blobs[layer.bottom[0]].data)
            outputs[path] = written
    assert outputs
    for top, value in outputs.items():
        assert np.all(np.isfinite(value)), '%s: %s is not finite' % (name, top)
        assert value.size == 1 or np.ptp(value) > 0, '%s: %s is constant' % (name, top)


@pytest.mark.parametrize('name, kept', [
    ('talent518_deeplab-public-ver2__exper_voc12_config_vgg16_test.prototxt',
     {'Input': 1, 'Interp': 1, 'Eltwise': 1}),
    ('alexgkendall_SegNet-Tutorial__Models_segnet_basic_train.prototxt',
     {'Input': 1, 'BN': 8, 'Upsample': 4, 'Softmax': 1}),
])
def test_fork_nets_deploy(name, kept, tmp_path, monkeypatch):
    """to-deploy leaves the test run's layers out (DeepLab's MatWrite and SegAccuracy, the
    losses, what reads the labels); the data layer becomes an Input of its crop or image."""
    monkeypatch.chdir(tmp_path)
    param = net_param(name)
    net_files(tmp_path, param)
    for layer in param.layer:        # the list the data layer reads: one image of 40 x 48
        if is_data_layer(layer):
            p = layer.dense_image_data_param if layer.type == 'DenseImageData' else \
                layer.image_data_param
            p.source, p.root_folder = str(tmp_path / 'list.txt'), str(tmp_path) + '/'
    cv2 = pytest.importorskip('cv2')
    cv2.imwrite(str(tmp_path / 'a.png'), np.zeros((40, 48, 3), np.uint8))
    cv2.imwrite(str(tmp_path / 'a_label.png'), np.zeros((40, 48), np.uint8))
    (tmp_path / 'list.txt').write_text('a.png a_label.png\n')
    deploy, _ = to_deploy(param)
    types = [layer.type for layer in deploy.layer]
    assert not {'MatWrite', 'SegAccuracy', 'Accuracy', 'Silence', 'SoftmaxWithLoss'} & set(types)
    for kind, count in kept.items():
        assert types.count(kind) == count, (kind, types)
    net = caffe.Net(deploy, caffe.TEST)
    assert net.blobs['data'].shape in ((1, 3, 513, 513), (4, 3, 40, 48))
