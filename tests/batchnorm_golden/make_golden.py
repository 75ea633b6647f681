#!/usr/bin/env python3
"""Write this folder's golden by training its net with BVLC Caffe on one device.

Run by hand with BVLC Caffe's pycaffe (see README.md), never by the tests:

    PYTHONPATH=$HOME/caffe-ref/caffe/python python3 tests/batchnorm_golden/make_golden.py

It writes init.caffemodel (the fillers' weights, which our runs load, as Caffe's and our
random generators differ) and bn_classifier.npz:
  input/train_data, input/train_label, input/test_data, input/test_label
                         the HDF5 files' rows (the tests write the files again)
  bn/<iter>/<layer>/<j>  blob j of BatchNorm <layer> after <iter> iterations (1..ITERS)
  resumed/<iter>/<layer>/<j>  the same after restoring snap_iter_<SNAPSHOT_AT> and training
                         on to <iter> (SNAPSHOT_AT + 1..ITERS)
  test/<iter>/<output>   the TEST net's outputs (accuracy, loss), mean over test_iter
                         batches, at iteration 0 and every TEST_EVERY
"""
import os
import shutil
import tempfile

import h5py
import numpy as np

os.environ.setdefault('GLOG_minloglevel', '2')
import caffe  # noqa: E402  (BVLC Caffe's pycaffe)

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = 'bn_classifier'
ITERS, SNAPSHOT_AT, TEST_EVERY = 20, 10, 5
BATCHNORMS = ('bn1', 'bn2')
TRAIN_ROWS, TEST_ROWS, CLASSES = 40, 16, 3     # 5 train batches of 8, 2 test batches


def rows(rs, count):
    """Images of three classes: a channel and a corner brighter by class, over an offset
    and noise that give the batch norms statistics far from 0 and 1."""
    label = rs.permutation(np.arange(count) % CLASSES)
    data = 2.0 + 1.5 * rs.standard_normal((count, 3, 8, 8))
    for i, c in enumerate(label):
        data[i, c] += 1.0
        data[i, :, 4 * (c % 2):4 * (c % 2) + 4, :4 * (c // 2 + 1)] += 0.5
    return data.astype(np.float32), label.astype(np.float32)


def write_data(folder, arrays):
    for split in ('train', 'test'):
        path = os.path.join(folder, split + '.h5')
        with h5py.File(path, 'w') as f:
            f['data'], f['label'] = arrays['input/%s_data' % split], arrays['input/%s_label' % split]
        with open(os.path.join(folder, split + '.txt'), 'w') as f:
            f.write(split + '.h5\n')


def batchnorm_blobs(net, prefix):
    return {'%s/%s/%d' % (prefix, name, j): net.params[name][j].data.copy()
            for name in BATCHNORMS for j in range(3)}


def test_outputs(solver, iteration, test_iter):
    """What Caffe's Solver::Test computes: each output's mean over test_iter batches."""
    net = solver.test_nets[0]
    net.share_with(solver.net)
    sums = {}
    for _ in range(test_iter):
        for name, value in net.forward().items():
            sums[name] = sums.get(name, 0.0) + float(value)
    return {'test/%d/%s' % (iteration, name): np.float32(v / test_iter) for name, v in sums.items()}


def main():
    caffe.set_mode_cpu()
    caffe.set_random_seed(1701)
    rs = np.random.RandomState(0)
    out = {}
    out['input/train_data'], out['input/train_label'] = rows(rs, TRAIN_ROWS)
    out['input/test_data'], out['input/test_label'] = rows(rs, TEST_ROWS)
    work = tempfile.mkdtemp()
    try:
        for name in (NAME + '.prototxt', NAME + '.solver.prototxt'):
            shutil.copy(os.path.join(HERE, name), work)
        os.chdir(work)                 # the sources and the snapshot prefix are relative
        write_data(work, out)
        solver_file = NAME + '.solver.prototxt'
        solver = caffe.SGDSolver(solver_file)
        solver.net.save(os.path.join(HERE, 'init.caffemodel'))
        test_iter = TEST_ROWS // 8
        out.update(test_outputs(solver, 0, test_iter))
        for it in range(1, ITERS + 1):
            solver.step(1)
            out.update(batchnorm_blobs(solver.net, 'bn/%d' % it))
            if it % TEST_EVERY == 0:
                out.update(test_outputs(solver, it, test_iter))
            if it == SNAPSHOT_AT:
                solver.snapshot()
        del solver
        resumed = caffe.SGDSolver(solver_file)
        resumed.restore('snap_iter_%d.solverstate' % SNAPSHOT_AT)
        for it in range(SNAPSHOT_AT + 1, ITERS + 1):
            resumed.step(1)
            out.update(batchnorm_blobs(resumed.net, 'resumed/%d' % it))
        del resumed
    finally:
        os.chdir(HERE)
        shutil.rmtree(work)
    np.savez_compressed(os.path.join(HERE, NAME + '.npz'), **out)
    last = 'bn/%d/bn1/' % ITERS
    print('s after %d iterations: %r; TEST accuracy %s' % (
        ITERS, out[last + '2'].tolist(),
        ', '.join('%d: %.4f' % (i, out['test/%d/accuracy' % i])
                  for i in range(0, ITERS + 1, TEST_EVERY))))


if __name__ == '__main__':
    main()
