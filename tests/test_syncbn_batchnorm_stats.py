"""-sync_bn keeps Caffe's BatchNorm statistics: a BatchNorm run as SyncBN accumulates
BVLC's sums (s = f*s + 1, mean_sum, var_sum) over the global batch, so its three blobs are
real Caffe's on one device with that batch, after every iteration and through a snapshot
and resume (tests/batchnorm_golden, made by BVLC Caffe); BN and SyncBN prototxts keep
their momentum average."""
import os

import h5py
import numpy as np
import pytest

from caffe_syncbn.formats.caffemodel import read_weights
from caffe_syncbn.training.solvers import get_solver
from caffe_syncbn.weights.copy import arrays_of

from helpers.paths import ROOT

GOLDEN = ROOT / 'tests' / 'batchnorm_golden'
NAME = 'bn_classifier'
ITERS, SNAPSHOT_AT, TEST_EVERY = 20, 10, 5
BATCHNORMS = ('bn1', 'bn2')
GLOBAL_BATCH = 8


@pytest.fixture(scope='module')
def golden():
    return dict(np.load(GOLDEN / (NAME + '.npz')))


def write_job(folder, golden, per_device):
    """The golden's data, net and solver in ``folder``, the train batch ``per_device``."""
    for split in ('train', 'test'):
        with h5py.File(folder / (split + '.h5'), 'w') as f:
            f['data'] = golden['input/%s_data' % split]
            f['label'] = golden['input/%s_label' % split]
        (folder / (split + '.txt')).write_text(split + '.h5\n')
    net = (GOLDEN / (NAME + '.prototxt')).read_text()
    train_layer = 'source: "train.txt" batch_size: %d'
    assert net.count(train_layer % GLOBAL_BATCH) == 1
    (folder / (NAME + '.prototxt')).write_text(
        net.replace(train_layer % GLOBAL_BATCH, train_layer % per_device))
    solver = (GOLDEN / (NAME + '.solver.prototxt')).read_text()
    (folder / (NAME + '.solver.prototxt')).write_text(solver)
    return str(folder / (NAME + '.solver.prototxt'))


def statistics(solver):
    """{blob key: array} of each BatchNorm's three statistics blobs, however the net holds
    them (BatchNorm's own three, or the last three of the SyncBN made of it)."""
    return {'%s/%d' % (name, j): np.array(blob.data).reshape(-1)
            for name in BATCHNORMS for j, blob in enumerate(solver.net.params[name][-3:])}


def train(folder, golden, devices, sync_bn):
    """Our run of the golden's: {'bn/<iter>/...', 'resumed/<iter>/...', 'test/<iter>/...'}
    and the snapshot's BatchNorm blobs as written (key 'snapshot/...')."""
    count = int(devices.split(':')[1])
    os.chdir(folder)                            # the sources and the prefix are relative
    job = write_job(folder, golden, GLOBAL_BATCH // count)
    init = [str(GOLDEN / 'init.caffemodel')]
    out = {}
    solver = get_solver(job, devices=devices, sync_bn=sync_bn, weights=init)
    try:
        out.update(('test/0/' + k, v) for k, v in solver.test(0).items())
        for it in range(1, ITERS + 1):
            solver.step(1)
            out.update(('bn/%d/%s' % (it, k), v) for k, v in statistics(solver).items())
            if it % TEST_EVERY == 0:
                out.update(('test/%d/%s' % (it, k), v) for k, v in solver.test(0).items())
            if it == SNAPSHOT_AT:
                model, state = solver.snapshot()
    finally:
        solver.close()
    written = arrays_of(read_weights(model))
    out.update(('snapshot/%s/%d' % (name, j), a) for name in BATCHNORMS
               for j, a in enumerate(written[name]))
    resumed = get_solver(job, devices=devices, sync_bn=sync_bn)
    try:
        resumed.restore(state)
        for it in range(SNAPSHOT_AT + 1, ITERS + 1):
            resumed.step(1)
            out.update(('resumed/%d/%s' % (it, k), v) for k, v in statistics(resumed).items())
    finally:
        resumed.close()
    return out


@pytest.fixture(scope='module')
def runs(golden, tmp_path_factory):
    """Ours: -sync_bn on 4 devices (2 images each) and on 1, and plain BatchNorm on 1."""
    before = os.getcwd()
    try:
        return {(devices, sync_bn): train(tmp_path_factory.mktemp('run'), golden, devices, sync_bn)
                for devices, sync_bn in (('cpu:4', True), ('cpu:1', True), ('cpu:1', False))}
    finally:
        os.chdir(before)


def blob_keys(prefix, iterations):
    return ['%s/%d/%s/%d' % (prefix, it, name, j)
            for it in iterations for name in BATCHNORMS for j in range(3)]


def assert_statistics_close(ours, theirs, keys, rtol, atol):
    for key in keys:
        np.testing.assert_allclose(ours[key], theirs[key].reshape(-1), rtol=rtol, atol=atol,
                                   err_msg=key)


def test_sync_bn_on_four_devices_keeps_caffes_batchnorm_blobs(golden, runs):
    ours = runs[('cpu:4', True)]
    factor = ours['bn/%d/bn1/2' % ITERS]
    assert factor == pytest.approx(golden['bn/%d/bn1/2' % ITERS], rel=1e-6)
    assert factor == pytest.approx(19.8111, abs=1e-4)          # not 1024, not an average
    assert_statistics_close(ours, golden, blob_keys('bn', range(1, ITERS + 1)), 1e-5, 1e-4)


def test_sync_bn_snapshot_writes_caffes_blobs_and_resumes_as_caffe_does(golden, runs):
    ours = runs[('cpu:4', True)]
    for name in BATCHNORMS:
        for j in range(3):
            np.testing.assert_array_equal(ours['snapshot/%s/%d' % (name, j)].reshape(-1),
                                          ours['bn/%d/%s/%d' % (SNAPSHOT_AT, name, j)])
    assert_statistics_close(ours, golden, blob_keys('resumed', range(SNAPSHOT_AT + 1, ITERS + 1)),
                            1e-5, 1e-4)


def test_sync_bn_test_scores_are_caffes(golden, runs):
    ours = runs[('cpu:4', True)]
    for it in range(0, ITERS + 1, TEST_EVERY):
        assert ours['test/%d/accuracy' % it] == golden['test/%d/accuracy' % it], it
        assert ours['test/%d/loss' % it] == pytest.approx(golden['test/%d/loss' % it],
                                                          rel=2e-5), it


def test_sync_bn_on_one_and_four_devices_equals_plain_batchnorm(runs):
    plain = runs[('cpu:1', False)]
    keys = blob_keys('bn', range(1, ITERS + 1)) + \
        blob_keys('resumed', range(SNAPSHOT_AT + 1, ITERS + 1))
    for run in (runs[('cpu:1', True)], runs[('cpu:4', True)]):
        assert_statistics_close(run, plain, keys, 1e-5, 1e-4)
        for key in plain:
            if key.startswith('test/'):
                assert run[key] == pytest.approx(plain[key], rel=2e-5), key
