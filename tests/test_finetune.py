"""Fine-tuning a BVLC BatchNorm+Scale caffemodel under --sync-bn, and the files it leaves.

The story a user lives: a caffemodel BVLC Caffe wrote (non-zero statistics, scale factor 2)
trains under --sync-bn on 2 virtual devices; its snapshots speak the user's prototxt
(BatchNorm+Scale), load into it and into the deploy net, give OpenCV's outputs, and resume
with or without --sync-bn, with the solverstate laid out as Caffe's own net expects.
"""
import re
import sys

import h5py
import numpy as np
import pytest
from helpers import watchdog

import caffe_syncbn as caffe
from caffe_syncbn.convert import to_syncbn
from caffe_syncbn.formats.caffemodel import read_net_param, read_weights
from caffe_syncbn.formats.solverstate import read_solver_state, write_solver_state
from caffe_syncbn.training.solvers import get_solver
from caffe_syncbn.weights.copy import arrays_of

from helpers.paths import GOLDEN, ROOT, require

TRAIN_NET = ROOT / 'tools' / 'train_net.py'
GOLDEN_MODEL = 'format_hdf5_caffemodel'

# the golden deploy net's layers, trained from an HDF5 source with a loss
NET = '''name: "format_hdf5_caffemodel"
layer { name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "%(list)s" batch_size: 2 } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "bn1" %(bn)s }
layer { name: "scale1" type: "Scale" bottom: "bn1" top: "scale1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "scale1" top: "scale1" }
layer { name: "pool1" type: "Pooling" bottom: "scale1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
        inner_product_param { num_output: 5 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
'''
SOLVER = '''net: "%(net)s"
type: "%(type)s" base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" max_iter: %(max_iter)d
display: 1 random_seed: 5 snapshot_prefix: "%(prefix)s" snapshot_format: %(format)s
'''
# SGD history: conv1 (2) + bn1 (3, statistics) + scale1 (2) + ip1 (2), as Caffe's net has them
USER_LAYOUT = [('conv1', (4, 3, 3, 3)), ('conv1', (4,)), ('bn1', (4,)), ('bn1', (4,)),
               ('bn1', (1,)), ('scale1', (4,)), ('scale1', (4,)), ('ip1', (5, 64)), ('ip1', (5,))]


def caffe_factor(start, iterations, fraction=0.999):
    """BatchNorm's scale factor s after ``iterations`` TRAIN steps from ``start``, as Caffe
    computes it (float32, s = f*s + 1)."""
    s, f = np.float32(start), np.float32(fraction)
    for _ in range(iterations):
        s = s * f + np.float32(1)
    return float(s)


def make_job(folder, max_iter=3, fmt='BINARYPROTO', solver_type='SGD', bn=''):
    """Data: 12 rows, three global batches of 2 x 2, so training cycles through them."""
    folder.mkdir(parents=True, exist_ok=True)
    rs = np.random.RandomState(0)
    with h5py.File(folder / 'data.h5', 'w') as f:
        f['data'] = rs.standard_normal((12, 3, 8, 8)).astype(np.float32)
        f['label'] = rs.randint(0, 5, 12).astype(np.float32)
    (folder / 'list.txt').write_text(str(folder / 'data.h5') + '\n')
    (folder / 'net.prototxt').write_text(NET % {'list': folder / 'list.txt', 'bn': bn})
    solver = folder / ('solver_%d.prototxt' % max_iter)
    solver.write_text(SOLVER % {'net': folder / 'net.prototxt', 'max_iter': max_iter,
                                'prefix': folder / 'snap', 'format': fmt, 'type': solver_type})
    return solver


def train(*args):
    out = watchdog.run([sys.executable, str(TRAIN_NET), *map(str, args)], capture_output=True,
                       text=True, limit=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_bvlc_model_finetunes_under_sync_bn_and_ships_in_its_own_terms(tmp_path):
    cv2 = pytest.importorskip('cv2')
    golden = require(GOLDEN / (GOLDEN_MODEL + '.caffemodel'))
    deploy = str(GOLDEN / (GOLDEN_MODEL + '.prototxt'))
    solver = make_job(tmp_path)
    log = train('--solver', solver, '--cpu-devices', 2, '--sync-bn', '--weights', golden)
    assert '--sync-bn: 1 layer(s) run as SyncBN (1 BatchNorm+Scale)' in log
    snapshot = str(tmp_path / 'snap_iter_3.caffemodel')
    stored = {layer.name: (layer.type, len(layer.blobs)) for layer in read_net_param(snapshot).layer}
    assert stored['bn1'] == ('BatchNorm', 3) and stored['scale1'] == ('Scale', 2)
    assert 'SyncBN' not in {kind for kind, _ in stored.values()}
    # Caffe's sums: the golden's s = 2, then three steps of s = f*s + 1
    factor = arrays_of(read_weights(snapshot))['bn1'][2]
    np.testing.assert_allclose(factor, [caffe_factor(2, 3)], rtol=1e-6)
    # the user's prototxt and the deploy net load it; OpenCV and we agree; it trained
    caffe.Net(str(tmp_path / 'net.prototxt'), caffe.TEST, weights=snapshot)
    x = np.load(GOLDEN / (GOLDEN_MODEL + '.npz'))['input/data']
    ours = caffe.Net(deploy, caffe.TEST, weights=snapshot).forward(data=x)['prob']
    theirs = cv2.dnn.readNetFromCaffe(deploy, snapshot)
    theirs.setInput(x)
    np.testing.assert_allclose(theirs.forward('prob'), ours, rtol=1e-4, atol=1e-6)
    converted = caffe.Net(to_syncbn(deploy)[0], caffe.TEST, weights=snapshot)
    np.testing.assert_array_equal(converted.forward(data=x)['prob'], ours)
    before = caffe.Net(deploy, caffe.TEST, weights=str(golden)).params['bn1']
    after = caffe.Net(deploy, caffe.TEST, weights=snapshot).params['bn1']
    assert not np.allclose(before[0].data / before[2].data, after[0].data / after[2].data)
    # the solverstate has the user's net's layout, and resumes both ways
    state = read_solver_state(str(tmp_path / 'snap_iter_3.solverstate'))
    assert [a.shape for a in state.history] == [shape for _, shape in USER_LAYOUT]
    assert not any(state.history[k].any() for k in (2, 3, 4))   # statistics are never learned
    longer = make_job(tmp_path, max_iter=5)
    user_net = str(tmp_path / 'net.prototxt')
    at_3 = caffe.Net(user_net, caffe.TEST, weights=snapshot).params['conv1'][0].data.copy()
    for flags in ([], ['--sync-bn']):
        log = train('--solver', longer, '--cpu-devices', 2, '--snapshot',
                    tmp_path / 'snap_iter_3.solverstate', *flags)
        assert 'restored iteration 3' in log and 'Iteration 4, loss = ' in log
        at_5 = caffe.Net(user_net, caffe.TEST, weights=str(tmp_path / 'snap_iter_5.caffemodel'))
        assert np.isfinite(at_5.params['conv1'][0].data).all()
        assert not np.array_equal(at_5.params['conv1'][0].data, at_3)     # it went on training


@pytest.mark.parametrize('fmt', ['BINARYPROTO', 'HDF5'])
def test_resuming_a_sync_bn_snapshot_continues_the_same_run(tmp_path, fmt):
    """6 iterations straight equal 3, a snapshot in the user's terms, and 3 more: the
    statistics, the slope and bias and their momentum history all survive the round trip."""
    suffix = '.h5' if fmt == 'HDF5' else ''
    golden = require(GOLDEN / (GOLDEN_MODEL + '.caffemodel.h5'))    # HDF5 weights too
    straight = make_job(tmp_path / 'straight', max_iter=6, fmt=fmt)
    train('--solver', straight, '--cpu-devices', 2, '--sync-bn', '--weights', golden)
    first = make_job(tmp_path / 'resumed', max_iter=3, fmt=fmt)
    train('--solver', first, '--cpu-devices', 2, '--sync-bn', '--weights', golden)
    second = make_job(tmp_path / 'resumed', max_iter=6, fmt=fmt)
    train('--solver', second, '--cpu-devices', 2, '--sync-bn', '--snapshot',
          tmp_path / 'resumed' / ('snap_iter_3.solverstate' + suffix))
    model = 'snap_iter_6.caffemodel' + suffix
    a = arrays_of(read_weights(str(tmp_path / 'straight' / model)))
    b = arrays_of(read_weights(str(tmp_path / 'resumed' / model)))
    assert list(a) == list(b)
    np.testing.assert_allclose(a['bn1'][2], [caffe_factor(2, 6)], rtol=1e-6)
    for name in a:
        for x, y in zip(a[name], b[name]):
            np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize('solver_type', ['SGD', 'Adam'])
def test_solverstate_history_maps_both_ways(tmp_path, solver_type):
    job = make_job(tmp_path, solver_type=solver_type)
    synced = get_solver(str(job), devices='cpu:2', sync_bn=True)
    try:
        synced.step(2)
        _, state_path = synced.snapshot()
        history = [np.array(h) for h in synced.rule.history]
    finally:
        synced.close()
    state = read_solver_state(state_path)
    sets = 2 if solver_type == 'Adam' else 1
    assert [a.shape for a in state.history] == [s for _, s in USER_LAYOUT] * sets
    plain = get_solver(str(job), devices='cpu:1')        # Caffe's own layout, no conversion
    try:
        plain.restore(state_path)
        assert plain.iter == 2
        for mine, saved in zip(plain.rule.history, state.history):
            np.testing.assert_array_equal(mine, saved)
    finally:
        plain.close()
    again = get_solver(str(job), devices='cpu:2', sync_bn=True)
    try:
        again.restore(state_path)
        for mine, before in zip(again.rule.history, history):
            np.testing.assert_array_equal(mine, before)
        # what earlier versions wrote: the converted net's own layout, whose SyncBN had no
        # scale factor blob (blob 4 of bn1, after conv1's 2)
        per_set = len(history) // sets
        legacy = [h for k, h in enumerate(history) if k % per_set != 6]
        write_solver_state(str(tmp_path / 'old.solverstate'), type(state)(
            2, state.learned_net, 0, legacy))
        again.restore(str(tmp_path / 'old.solverstate'))
        for mine, before in zip(again.rule.history, history):
            np.testing.assert_array_equal(mine, before)
        write_solver_state(str(tmp_path / 'short.solverstate'), type(state)(2, '', 0, history[:3]))
        with pytest.raises(caffe.CaffeError, match=r"short.solverstate has 3 history blobs, but "
                                                   r"a %s solver on net '\S+' needs %d or %d"
                                                   % (solver_type, 9 * sets, 8 * sets)):
            again.restore(str(tmp_path / 'short.solverstate'))
    finally:
        again.close()


def test_sync_bn_says_what_it_converts(tmp_path):
    frozen = make_job(tmp_path / 'frozen', max_iter=1,
                      bn='batch_norm_param { use_global_stats: true }')
    log = train('--solver', frozen, '--cpu-devices', 2, '--sync-bn')
    assert re.search(r'1 of them keep their running statistics .*: bn1', log)
    plain = make_job(tmp_path / 'plain', max_iter=1)
    text = (tmp_path / 'plain' / 'net.prototxt').read_text()
    start, end = text.index('layer { name: "bn1"'), text.index('layer { name: "relu1"')
    (tmp_path / 'plain' / 'net.prototxt').write_text(
        (text[:start] + text[end:]).replace('"scale1" bottom: "scale1"', '"scale1" bottom: "conv1"')
        .replace('bottom: "scale1" top: "scale1" }', 'bottom: "conv1" top: "conv1" }')
        .replace('bottom: "scale1" top: "pool1"', 'bottom: "conv1" top: "pool1"'))
    log = train('--solver', plain, '--cpu-devices', 2, '--sync-bn')
    assert re.search(r'^W\d{4} .*has no BatchNorm or BN layer; nothing is synchronized', log,
                     re.M), log
