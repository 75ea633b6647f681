"""MultiBoxLoss against the SSD fork (goldens in tests/ssd_golden, see its README.md),
finite differences, and N data-parallel replicas against one device on the whole batch."""
import threading

import numpy as np
import pytest
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2
from caffe_syncbn.comm import ThreadComm
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.blob import Blob
from caffe_syncbn.layer import LayerContext, create_layer
from caffe_syncbn.testing import build_layer, check_gradient
from helpers.paths import SSD_GOLDEN as GOLDEN

CASES = sorted(p.stem for p in GOLDEN.glob('multibox_loss_*.npz'))
BOTTOMS = ('loc', 'conf', 'priors', 'label')


def golden(name):
    net = text_format.Parse((GOLDEN / (name + '.prototxt')).read_text(), caffe_pb2.NetParameter())
    return net.layer[-1], np.load(GOLDEN / (name + '.npz'))


def run_case(name, dtype):
    param, ref = golden(name)
    layer, bottom, top = build_layer(param, [ref['data/' + b] for b in BOTTOMS], dtype=dtype)
    layer.forward(bottom, top)
    top[0].diff[...] = ref['topdiff/loss']
    layer.backward(top, list(param.propagate_down), bottom)
    return param, ref, layer, bottom, top


def test_every_golden_case_is_here():
    assert len(CASES) == 7


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('name', CASES)
def test_loss_and_gradients_match_the_fork(name, dtype):
    param, ref, layer, bottom, top = run_case(name, dtype)
    np.testing.assert_allclose(float(top[0].data), float(ref['data/loss']), rtol=2e-5)
    loc_diff = ref['diff/loc']
    if param.multibox_loss_param.encode_variance_in_target:
        # the fork divides predictions by the variances but leaves that factor out of
        # its gradient; this layer keeps it
        variances = np.tile(ref['data/priors'][0, 1], (loc_diff.shape[0], 1))
        loc_diff = loc_diff / variances
        assert np.abs(ref['diff/loc']).max() > 1e-3
    if param.propagate_down[0]:
        np.testing.assert_allclose(bottom[0].diff, loc_diff, rtol=1e-4, atol=1e-7)
        assert np.count_nonzero(loc_diff) > 0
    np.testing.assert_allclose(bottom[1].diff, ref['diff/conf'], rtol=1e-4, atol=1e-7)


def test_loss_counts_only_the_terms_whose_bottom_learns():
    """The fork adds the localization term only when propagate_down lets loc learn."""
    _, ref, layer, bottom, top = run_case('multibox_loss_conf_only', np.float64)
    param, _ = golden('multibox_loss_conf_only')
    param.ClearField('propagate_down')
    both, b2, t2 = build_layer(param, [ref['data/' + b] for b in BOTTOMS])
    both.forward(b2, t2)
    assert float(t2[0].data) > float(top[0].data) + 1e-3


def small_problem(rs, images=2, priors=30, classes=3):
    centres = rs.uniform(0.25, 0.75, (priors, 2))
    sizes = rs.uniform(0.15, 0.4, (priors, 2))
    boxes = np.concatenate([centres - sizes / 2, centres + sizes / 2], axis=1)
    prior_blob = np.stack([boxes.ravel(), np.tile([0.1, 0.1, 0.2, 0.2], priors)])[None]
    rows = []
    for image in range(images):
        for _ in range(2):
            xy = rs.uniform(0.1, 0.5, 2)
            rows.append([image, rs.randint(1, classes), 0, *xy, *(xy + rs.uniform(0.2, 0.4, 2)), 0])
    return [rs.standard_normal((images, priors * 4)) * 0.3,
            rs.standard_normal((images, priors * classes)),
            prior_blob, np.array(rows)[None, None]]


@pytest.mark.parametrize('setting', [
    'code_type: CENTER_SIZE',
    'code_type: CORNER loc_loss_type: L2 conf_loss_type: LOGISTIC',
    'code_type: CORNER_SIZE mining_type: HARD_EXAMPLE sample_size: 8',
])
def test_gradient_matches_finite_differences(setting):
    bottoms = small_problem(np.random.RandomState(3))
    text = ('type: "MultiBoxLoss" bottom: "l" bottom: "c" bottom: "p" bottom: "g" top: "loss" '
            'multibox_loss_param { num_classes: 3 overlap_threshold: 0.3 %s }' % setting)
    check_gradient(text, bottoms, check_bottom=[0, 1], step=1e-6, tolerance=1e-5)


def run_replica(param, bottoms, comm, results, rank):
    ctx = LayerContext(dtype=np.float64, comm=comm)
    layer = create_layer(param, ctx)
    bottom = [Blob(np.shape(b), np.float64) for b in bottoms]
    for blob, array in zip(bottom, bottoms):
        blob.data[...] = array
    top = [Blob((), np.float64)]
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    top[0].diff[...] = 1
    layer.backward(top, [True, True, False, False], bottom)
    results[rank] = (float(top[0].data), bottom[0].diff.copy(), bottom[1].diff.copy())


def local_labels(labels, first, count):
    rows = labels.reshape(-1, 8)
    mine = rows[(rows[:, 0] >= first) & (rows[:, 0] < first + count)].copy()
    mine[:, 0] -= first
    return mine[None, None]


@pytest.mark.parametrize('normalization', ['VALID', 'FULL', 'BATCH_SIZE', 'NONE'])
def test_replicas_equal_one_device_on_the_whole_batch(normalization):
    replicas, per_replica = 4, 2
    loc, conf, priors, labels = small_problem(np.random.RandomState(5), images=8)
    param = text_format.Parse(
        'name: "mbox" type: "MultiBoxLoss" bottom: "l" bottom: "c" bottom: "p" bottom: "g" '
        'top: "loss" loss_param { normalization: %s } '
        'multibox_loss_param { num_classes: 3 code_type: CENTER_SIZE overlap_threshold: 0.3 }'
        % normalization, caffe_pb2.LayerParameter())
    whole = {}
    run_replica(param, [loc, conf, priors, labels], None, whole, 0)
    comms = ThreadComm.create(replicas)
    results = {}
    threads = []
    for rank in range(replicas):
        part = slice(rank * per_replica, (rank + 1) * per_replica)
        bottoms = [loc[part], conf[part], priors, local_labels(labels, part.start, per_replica)]
        threads.append(threading.Thread(target=run_replica,
                                        args=(param, bottoms, comms[rank], results, rank)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    loss, loc_diff, conf_diff = whole[0]
    # the solver averages the replicas' losses and gradients
    assert np.mean([results[r][0] for r in range(replicas)]) == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(np.concatenate([results[r][1] for r in range(replicas)]) / replicas,
                               loc_diff, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.concatenate([results[r][2] for r in range(replicas)]) / replicas,
                               conf_diff, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize('change, message', [
    ('label_background', 'has the background label 0'),
    ('item_outside', 'item_id 7 outside the batch of 2 images'),
    ('prior_shape', r'priors \(bottom 2\) must be a PriorBox top'),
])
def test_bad_input_names_the_layer(change, message):
    bottoms = small_problem(np.random.RandomState(1))
    labels = bottoms[3].reshape(-1, 8)
    if change == 'label_background':
        labels[0, 1] = 0
    elif change == 'item_outside':
        labels[1, 0] = 7
    else:
        bottoms[2] = bottoms[2].reshape(2, 1, -1)
    text = ('name: "mbox" type: "MultiBoxLoss" bottom: "l" bottom: "c" bottom: "p" bottom: "g" '
            'top: "loss" multibox_loss_param { num_classes: 3 }')
    with pytest.raises(CaffeError, match=message) as info:
        layer, bottom, top = build_layer(text, bottoms)
        layer.forward(bottom, top)
    assert 'mbox' in str(info.value)
