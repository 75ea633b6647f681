"""The full-size MobileNet-SSD (300x300, 21 classes; tests/ssd_golden/mobilenet_ssd.py writes
the net and draws its weights from a seed) against the SSD fork's forward of the same net,
weights and images (tests/ssd_golden/mobilenet_ssd.npz, made by make_goldens.py)."""
import pathlib

import numpy as np
import pytest
from ssd_golden import mobilenet_ssd

from caffe_syncbn import TEST, Net, caffe_pb2
from caffe_syncbn.netparam.prototxt import parse_text

GOLDEN = pathlib.Path(__file__).parent / 'ssd_golden'


@pytest.fixture(scope='module')
def runs():
    ref = np.load(GOLDEN / 'mobilenet_ssd.npz')
    net = Net(parse_text(mobilenet_ssd.prototxt(), caffe_pb2.NetParameter()), TEST)
    for name, arrays in mobilenet_ssd.weights(int(ref['weight_seed'])).items():
        for blob, array in zip(net.params[name], arrays):
            blob.data[...] = array
    images = mobilenet_ssd.images(int(ref['image_seed']))
    net.blobs['data'].reshape(*images.shape)
    net.reshape()
    net.forward(data=images)
    return ref, net


def test_the_golden_has_varied_detections(runs):
    ref, _ = runs
    rows = ref['data/detection_out'][0, 0]
    assert set(rows[:, 0]) == {0, 1}                 # both images have detections
    assert len(set(rows[:, 1])) >= 5                 # of several classes
    assert len(set(rows[:, 2])) == len(rows)         # no tied scores
    assert rows[:, 2].max() - rows[:, 2].min() > 0.2
    assert (rows[:, 2] > 0.01).all()


@pytest.mark.parametrize('blob', ['conv16_2', 'conv17_2', 'mbox_loc'])
def test_features_match_the_fork(runs, blob):
    ref, net = runs
    want = ref['data/' + blob]
    np.testing.assert_allclose(net.blobs[blob].data, want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max(), err_msg=blob)


def test_detections_match_the_fork(runs):
    ref, net = runs
    ours, theirs = net.blobs['detection_out'].data[0, 0], ref['data/detection_out'][0, 0]
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours[:, :2], theirs[:, :2])      # image, label
    np.testing.assert_allclose(ours[:, 2], theirs[:, 2], rtol=0, atol=1e-4)
    np.testing.assert_allclose(ours[:, 3:], theirs[:, 3:], rtol=0, atol=1e-4)
