"""The small MobileNet-SSD-like net of tests/ssd_golden through the converters and other
runtimes: OpenCV's Caffe importer gives our detections, fold-bn keeps them, and the ONNX
export up to the heads gives our loc / conf / prior blobs."""
import pathlib

import numpy as np
import pytest
from google.protobuf import text_format

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.convert import fold_bn
from caffe_syncbn.errors import CaffeError

GOLDEN = pathlib.Path(__file__).parent / 'ssd_golden'
PROTOTXT = str(GOLDEN / 'mini_ssd_deploy.prototxt')
WEIGHTS = str(GOLDEN / 'mini_ssd.caffemodel')
HEADS = ('mbox_loc', 'mbox_conf_flatten', 'mbox_priorbox')


@pytest.fixture(scope='module')
def reference():
    ref = np.load(GOLDEN / 'mini_ssd.npz')
    net = caffe.Net(PROTOTXT, caffe.TEST, weights=WEIGHTS)
    net.forward(data=ref['data/data'])
    return ref['data/data'], {name: net.blobs[name].data.copy()
                              for name in HEADS + ('detection_out',)}


def by_image_label_score(rows):
    """Detection rows in (image, label, descending score) order."""
    rows = rows.reshape(-1, 7)
    return rows[np.lexsort((-rows[:, 2], rows[:, 1], rows[:, 0]))]


def test_opencv_gives_our_detections(reference):
    cv2 = pytest.importorskip('cv2', reason='OpenCV is absent: pip install '
                                            '"opencv-python-headless<5"')
    image, ours = reference
    theirs = cv2.dnn.readNetFromCaffe(PROTOTXT, WEIGHTS)
    theirs.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    theirs.setInput(image)
    detections, priors = theirs.forward(['detection_out', 'mbox_priorbox'])
    np.testing.assert_allclose(priors, ours['mbox_priorbox'], atol=1e-6)
    # OpenCV orders an image's rows by score over all labels; the rows are the same
    assert detections.shape == ours['detection_out'].shape
    theirs_rows = by_image_label_score(detections)
    ours_rows = by_image_label_score(ours['detection_out'])
    np.testing.assert_array_equal(ours_rows[:, :2], theirs_rows[:, :2])
    np.testing.assert_allclose(ours_rows[:, 2:], theirs_rows[:, 2:], atol=1e-4)


def test_fold_bn_keeps_the_detections(reference):
    image, ours = reference
    net = caffe.Net(PROTOTXT, caffe.TEST, weights=WEIGHTS)
    weights = {name: [np.array(b.data) for b in blobs] for name, blobs in net.params.items()}
    param, folded = fold_bn(net.net_param, weights)
    types = [layer.type for layer in param.layer]
    assert 'BatchNorm' not in types and 'Scale' not in types, types
    folded_net = caffe.Net(param, caffe.TEST, weights=folded)
    folded_net.forward(data=image)
    result = folded_net.blobs['detection_out'].data
    assert result.shape == ours['detection_out'].shape
    np.testing.assert_array_equal(result[..., :2], ours['detection_out'][..., :2])
    np.testing.assert_allclose(result, ours['detection_out'], atol=1e-5)


def heads_only():
    param = text_format.Parse(pathlib.Path(PROTOTXT).read_text(), caffe_pb2.NetParameter())
    assert param.layer[-1].type == 'DetectionOutput'
    del param.layer[-1]
    return param


@pytest.mark.parametrize('dynamic_batch', [False, True])
def test_onnx_export_up_to_the_heads(reference, dynamic_batch):
    pytest.importorskip('onnxruntime')
    from caffe_syncbn.export import to_onnx
    from helpers.onnx_helpers import assert_close, run
    image, ours = reference
    model = to_onnx(heads_only(), WEIGHTS, dynamic_batch=dynamic_batch)
    outputs = run(model, {'data': image})
    assert sorted(outputs) == sorted(HEADS)
    for name in HEADS:
        assert_close(outputs[name], ours[name], name)
    if dynamic_batch:         # the priors are a constant: one image gives the same
        single = run(model, {'data': image[:1]})
        assert_close(single['mbox_loc'], ours['mbox_loc'][:1], 'mbox_loc')
        assert_close(single['mbox_priorbox'], ours['mbox_priorbox'], 'mbox_priorbox')


def test_onnx_export_of_detection_output_says_what_to_export():
    pytest.importorskip('onnx')
    from caffe_syncbn.export import to_onnx
    with pytest.raises(CaffeError) as info:
        to_onnx(PROTOTXT, WEIGHTS)
    message = str(info.value)
    assert '\n' not in message
    assert "'detection_out' (DetectionOutput)" in message
    assert message.endswith('export up to its bottoms, to decode outside the model: '
                            '--outputs mbox_loc,mbox_conf_flatten,mbox_priorbox')


def test_onnx_export_with_the_outputs_the_refusal_names(reference, tmp_path):
    """What the refusal says works as it says, through the command line."""
    onnx = pytest.importorskip('onnx')
    pytest.importorskip('onnxruntime')
    from caffe_syncbn.cli.convert import main
    from helpers.onnx_helpers import assert_close, run
    image, ours = reference
    main(['to-onnx', '--model', PROTOTXT, '--weights', WEIGHTS, '--output',
          str(tmp_path / 'heads'), '--outputs', ','.join(HEADS)])
    model = onnx.load(str(tmp_path / 'heads.onnx'))
    assert [layer_output.name for layer_output in model.graph.output] == list(HEADS)
    outputs = run(model, {'data': image})
    for name in HEADS:
        assert_close(outputs[name], ours[name], name)
    with pytest.raises(CaffeError, match=r"^outputs: net '.*' has no blob 'nope'"):
        main(['to-onnx', '--model', PROTOTXT, '--output', str(tmp_path / 'x'),
              '--outputs', 'nope'])
