"""Real prototxts of the YOLO ports, RefineDet and caffe_ocr (tests/fork_corpus, sources in
its SOURCES.tsv) build as their forks wrote them and run with random weights (fan-in
scaled, batch norms given statistics from their input): the deploy nets forward in TEST at
a small input and at their own, the training nets forward and backward in TRAIN (their data
layers swapped for Input layers fed with labels in the fork's layout, at a small input) and
forward in TEST where they have a test net. The layers' numbers are tested in tests/layers;
here the nets' wiring, and shapes and outputs as the forks define them."""
import numpy as np
import pytest

import caffe_syncbn as caffe
from caffe_syncbn.netparam.inputs import swap_data_layers_for_inputs
from caffe_syncbn.netparam.upgrade import load_net_param
from helpers.model_weights import calibrate, random_weights
from helpers.paths import ROOT

CORPUS = ROOT / 'tests' / 'fork_corpus'
YOLOV2 = 'eric612_MobileNet-YOLO__models_yolov2_mobilenet_yolo_deploy.prototxt'
YOLOV3 = 'eric612_MobileNet-YOLO__models_yolov3_mobilenet_yolov3_lite_deploy.prototxt'
DARKNET = 'eric612_MobileNet-YOLO__models_darknet_darknet19_deploy.prototxt'
REFINEDET = 'mkchoi-0323_modified_refinedet__deploys_vgg16_320x320_deploy_1000.prototxt'
REFINEDET_TRAIN = 'mkchoi-0323_modified_refinedet__deploys_vgg16_512x512_train.prototxt'
OCR_RESNET = 'senlinuc_caffe_ocr__examples_ocr_resnet_deploy.prototxt'
OCR_INCEPTION = 'senlinuc_caffe_ocr__examples_ocr_inception-bn_deploy.prototxt'
OCR_TRAIN = 'senlinuc_caffe_ocr__examples_ocr_resnet_ResNet-train_val.prototxt'

#: deploy nets: (the input's height and width here, the net's own, the input's range: the
#: YOLO ports scale pixels to [-1, 1], caffe_ocr subtracts a mean only; RefineDet too, but
#: its VGG without batch norms passes a pixel range on to scores and offsets, and random
#: offsets of that size move the priors out of float32's range)
DEPLOY = {
    YOLOV2: ((160, 160), (416, 416), 1),
    YOLOV3: ((160, 160), (320, 320), 1),
    DARKNET: ((160, 160), (416, 416), 1),
    REFINEDET: ((128, 128), (320, 320), 32),
    OCR_RESNET: ((32, 280), (32, 280), 128),
    OCR_INCEPTION: ((32, 280), (32, 280), 128),
}
#: training nets: the input's height and width here (RefineDet's own is 512 x 512)
TRAIN = {REFINEDET_TRAIN: (128, 128), OCR_TRAIN: (32, 280)}
#: ground truth boxes per image and labels per text line fed to the training nets
BOXES, LABELS_PER_LINE = 3, 10


def test_every_corpus_file_is_listed_with_its_source():
    files = sorted(p.name for p in CORPUS.glob('*.prototxt'))
    sources = dict(line.split('\t') for line in
                   (CORPUS / 'SOURCES.tsv').read_text().splitlines())
    mine = sorted(DEPLOY) + sorted(TRAIN)
    assert set(mine) <= set(files) and set(mine) <= set(sources)
    for name in mine:
        owner_repo, path = name[:-len('.prototxt')].split('__', 1)
        url = sources[name]
        assert url.startswith('https://github.com/') and '/blob/' in url, url
        commit = url.split('/blob/')[1].split('/')[0]
        assert len(commit) == 40 and url.endswith('.prototxt')
        assert url.split('/blob/')[1].split('/', 1)[1].replace('/', '_') == path + '.prototxt'
        assert url.startswith('https://github.com/%s/' % owner_repo.replace('_', '/', 1))


def layer_of(param, type_name):
    return next(layer for layer in param.layer if layer.type == type_name)


def with_weights(net, seed=0):
    """Gives ``net`` its weights; returns its outputs (calibrating runs every layer)."""
    rng = np.random.default_rng(seed)
    return calibrate(net, random_weights(net, rng), rng)


def run_deploy(name, size):
    param = load_net_param(CORPUS / name)
    for layer in param.layer:
        if layer.type == 'Input':
            layer.input_param.shape[0].dim[2:] = list(size)
        # keep every YOLOv2 box: the suppression then has hundreds of candidates to sort
        if layer.type == 'YoloDetectionOutput':
            layer.yolo_detection_output_param.confidence_threshold = 0.0
    net = caffe.Net(param, caffe.TEST)
    scale = DEPLOY[name][2]
    net.blobs['data'].data[...] = np.random.default_rng(1).uniform(
        -scale, scale, net.blobs['data'].shape)
    return param, net, with_weights(net)


@pytest.mark.parametrize('name, size', [(name, size) for name, sizes in sorted(DEPLOY.items())
                                         for size in sorted(set(sizes[:2]))])
def test_fork_deploy_net_runs_forward(name, size):
    """At a small input and at the net's own."""
    check_deploy(name, size)


def check_deploy(name, size):
    param, net, out = run_deploy(name, size)
    if 'caffe_ocr' in name:
        check_sequences(param, net, out['result'])
        return
    rows = out['detection_out'].reshape(-1, 7)
    assert out['detection_out'].shape[:2] == (1, 1) and len(rows) > 10
    assert np.all(np.isfinite(rows))
    if name == REFINEDET:
        check_refinedet_rows(param, net, rows)
    else:
        check_yolo_rows(param, net, rows, size)


def check_sequences(param, net, result):
    """CTCGreedyDecoder's top, (N, T, 1, 1): per step of the time-major scores (T, N, C),
    the classes of the greedy decoding, then -1."""
    steps, num, classes = net.blobs[layer_of(param, 'CTCGreedyDecoder').bottom[0]].shape[:3]
    # the recurrent part runs over the columns the convolutions leave of the 280 pixels
    assert 10 < steps < 280 and num == 1 and classes == 5990
    assert result.shape == (num, steps, 1, 1)
    decoded = result.reshape(-1)
    assert np.all((decoded >= -1) & (decoded < classes)) and np.all(decoded == np.round(decoded))
    written = decoded[decoded >= 0]
    assert len(written) and np.all(decoded[len(written):] == -1)
    assert not np.any(written == 0)               # the blank never reaches the output


def check_yolo_rows(param, net, rows, size):
    """[image, label + 1, confidence, xmin, ymin, xmax, ymax], best first; a box's centre
    lies in its cell, so inside the image, and its sides come from exp() (positive)."""
    if any(layer.type == 'Yolov3DetectionOutput' for layer in param.layer):
        output = layer_of(param, 'Yolov3DetectionOutput')
        settings = output.yolov3_detection_output_param
        values = 4 + 1 + settings.num_classes
    else:
        output = layer_of(param, 'YoloDetectionOutput')
        settings = output.yolo_detection_output_param
        values = settings.coords + 1 + settings.num_classes
    heads = [net.blobs[b].shape for b in output.bottom]
    # every head has its boxes' values as channels; the coarsest has a cell per 32 pixels
    assert all(head[1] == settings.num_box * values for head in heads)
    assert min(head[2] for head in heads) == size[0] // 32
    assert len(rows) <= sum(np.prod(head[2:]) for head in heads) * settings.num_box
    assert np.all(rows[:, 0] == 0)
    assert np.all((rows[:, 1] >= 1) & (rows[:, 1] <= settings.num_classes))
    assert np.all(rows[:, 1] == np.round(rows[:, 1]))
    assert np.all((rows[:, 2] >= settings.confidence_threshold) & (rows[:, 2] <= 1))
    assert np.all(np.diff(rows[:, 2]) <= 0)
    centres = (rows[:, 3:5] + rows[:, 5:7]) / 2
    assert np.all((centres >= 0) & (centres <= 1))
    assert np.all(rows[:, 5:7] > rows[:, 3:5])


def check_refinedet_rows(param, net, rows):
    """SSD's rows after RefineDet's two steps: labels of the 80 classes (not the
    background), scores of a softmax, at most keep_top_k rows, boxes decoded from priors
    that the ARM moved."""
    settings = layer_of(param, 'DetectionOutput').detection_output_param
    assert len(rows) <= settings.keep_top_k
    assert np.all(rows[:, 0] == 0)
    assert np.all((rows[:, 1] >= 1) & (rows[:, 1] < settings.num_classes))
    assert np.all((rows[:, 2] >= settings.confidence_threshold) & (rows[:, 2] <= 1))
    assert np.all(rows[:, 5:7] >= rows[:, 3:5])
    priors = net.blobs['arm_priorbox'].shape[2] // 4
    assert net.blobs['odm_conf_flatten'].shape[1] == priors * settings.num_classes


def build_train(name, phase, num=2, per_line=LABELS_PER_LINE):
    height, width = TRAIN[name]
    shapes = {'data': (num, 3, height, width)}
    if name == OCR_TRAIN:                 # caffe_ocr's Data: (N, labels per line, 1, 1)
        shapes['label'] = (num, per_line, 1, 1)
    else:                                 # AnnotatedData: one row per ground truth box
        shapes['label'] = (1, 1, num * BOXES, 8)
    param = load_net_param(CORPUS / name)
    for layer in param.layer:
        if layer.type == 'AnnotatedData':     # SSD's, which the swap does not know
            layer.type = 'Data'
    param = swap_data_layers_for_inputs(param, shapes=shapes)
    net = caffe.Net(param, phase)
    rng = np.random.default_rng(2)
    net.blobs['data'].data[...] = rng.uniform(-128, 128, shapes['data'])
    net.blobs['label'].data[...] = labels(name, shapes['label'], rng)
    with_weights(net)
    return param, net


def labels(name, shape, rng):
    if name == OCR_TRAIN:
        # classes 1..5989 (0 is the blank), the end of a line padded with blanks
        lines = rng.integers(1, 5990, shape)
        lines[0, 7:] = 0
        return lines
    # [image, class, instance, xmin, ymin, xmax, ymax, difficult]
    num = shape[2] // BOXES
    corners = np.sort(rng.uniform(0, 1, (num * BOXES, 2, 2)), axis=1).reshape(-1, 4)
    return np.column_stack([np.repeat(np.arange(num), BOXES), rng.integers(1, 81, num * BOXES),
                            np.tile(np.arange(BOXES), num), corners,
                            np.zeros(num * BOXES)]).reshape(1, 1, -1, 8)


@pytest.mark.parametrize('name', sorted(TRAIN))
def test_fork_training_net_trains(name):
    """TRAIN: a finite positive loss and a finite, non-zero gradient at the first layer."""
    param, net = build_train(name, caffe.TRAIN)
    losses = net.forward()
    expected = {'ctcloss'} if name == OCR_TRAIN else {'arm_loss', 'odm_loss'}
    assert set(losses) == expected
    for loss in losses.values():
        assert loss.shape == () and np.isfinite(loss) and loss > 0
    net.backward()
    gradient = next(layer for layer in net.layers if layer.blobs).blobs[0].diff
    assert np.all(np.isfinite(gradient)) and np.any(gradient != 0)


def test_ocr_training_net_tests():
    """caffe_ocr's test net: the loss, and CTCGreedyDecoder's accuracy (1 - the mean
    normalized edit distance, the share of exact lines): below 1 for random lines, 1 and 1
    for the lines the net reads, each step's best class with repeats and blanks dropped."""
    width = TRAIN[OCR_TRAIN][1]
    _, net = build_train(OCR_TRAIN, caffe.TEST, per_line=width)
    out = net.forward()
    assert set(out) == {'ctcloss', 'acc'} and out['acc'].shape == (1, 2, 1, 1)
    assert np.isfinite(out['ctcloss']) and out['ctcloss'] > 0
    assert 0 <= out['acc'][0, 0] < 1 and out['acc'][0, 1] == 0
    best = net.blobs['fc1x'].data.argmax(axis=2).T          # (N, T) of the (T, N, C) scores
    assert best.shape[1] < width
    read = np.zeros(net.blobs['label'].shape[:2])
    for line, steps in zip(read, best):
        kept = [c for i, c in enumerate(steps) if c != 0 and (i == 0 or c != steps[i - 1])]
        assert kept, 'a line the net reads as empty proves nothing'
        line[:len(kept)] = kept
    net.blobs['label'].data[...] = read.reshape(net.blobs['label'].shape)
    out = net.forward()
    np.testing.assert_array_equal(out['acc'].reshape(2), [1, 1])
