"""The demo (examples/demo.py, examples/segmentation/): its dataset, and the pair of runs
that compares SyncBN with per-device BN. The runs here are a few iterations long, so no
accuracy is asserted: only that both modes train and report, and that they differ in
the BN mode alone (one solver, one net, one initial weights file, the same images)."""
import json
import sys

import numpy as np
import pytest

from caffe_syncbn.analysis.logparse import parse_log
from caffe_syncbn.formats.caffemodel import read_net_param
from caffe_syncbn.training.solvers import get_solver

from helpers.paths import ROOT

cv2 = pytest.importorskip('cv2')
pytest.importorskip('matplotlib')

sys.path.insert(0, str(ROOT / 'examples' / 'segmentation'))
import compare  # noqa: E402
import make_dataset  # noqa: E402
import memory_fit  # noqa: E402
import precision  # noqa: E402
import sweep  # noqa: E402

TINY_SOLVER = {'max_iter': 4, 'test_interval': 2, 'test_iter': 1, 'display': 1}


@pytest.fixture(scope='module')
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp('pair')
    data = str(out / 'data')
    make_dataset.make_dataset(data, train=8, val=8, seed=3)
    results = compare.run_pair(str(out), data, seed=5, devices=['--cpu-devices', '4'],
                               solver_overrides=TINY_SOLVER, progress=lambda line: None)
    return out, results


def test_dataset_is_deterministic_and_each_image_has_its_own_exposure(tmp_path):
    make_dataset.make_dataset(str(tmp_path / 'a'), train=16, val=2, seed=7)
    make_dataset.make_dataset(str(tmp_path / 'b'), train=16, val=2, seed=7)
    for name in ('images/train_0003.jpg', 'labels/val_0001.png', 'train.txt'):
        assert (tmp_path / 'a' / name).read_bytes() == (tmp_path / 'b' / name).read_bytes()
    images = np.stack([cv2.imread(str(tmp_path / 'a' / 'images' / ('train_%04d.jpg' % i)))
                       for i in range(16)]).astype(np.float64)
    means, stds = images.mean(axis=(1, 2, 3)), images.std(axis=(1, 2, 3))
    assert means.max() - means.min() > 60 and stds.max() > 2 * stds.min()
    labels = [cv2.imread(str(tmp_path / 'a' / 'labels' / ('train_%04d.png' % i)),
                         cv2.IMREAD_UNCHANGED) for i in range(16)]
    assert all(label.dtype == np.uint8 and set(np.unique(label)) <= {0, 1, 2, 3, 4, 255}
               for label in labels)
    classes_per_image = {len(set(np.unique(label)) - {0, 255}) for label in labels}
    assert len(classes_per_image) > 1                 # the class mix varies from image to image


def test_both_modes_train_and_report(pair):
    out, results = pair
    assert [folder for folder, _, _ in compare.MODES] == list(results)
    assert json.loads((out / 'results.json').read_text()) == results
    for run in results.values():
        train, test = parse_log(run['log'])
        assert [row['iteration'] for row in test] == [2, 4]
        assert all(np.isfinite(row['loss']) for row in train) and len(train) >= 3
        assert all('accuracy' in row and 'loss' in row for row in test)
        assert 0 <= run['pixel_accuracy'] <= 1 and 0 <= run['mean_iou'] <= 1
        assert read_net_param(run['snapshot']).layer
    assert 0 <= results['per-device']['own_statistics_mean_iou'] <= 1
    plot = compare.plot_pair(str(out / 'pair.png'), results, 'test')
    assert open(plot, 'rb').read(8) == b'\x89PNG\r\n\x1a\n'


def test_the_runs_differ_in_the_bn_mode_alone(pair):
    out, results = pair
    sync, plain = (results[folder]['command'] for folder, _, _ in compare.MODES)

    def without(command, *options):        # the options whose values are per run
        kept = list(command)
        for option in options:
            i = kept.index(option)
            del kept[i:i + 2]
        return kept
    assert without(sync, '--log-file') == without(plain, '--log-file') + ['--sync-bn']
    init = str(out / 'init.caffemodel')
    assert sync[sync.index('--weights') + 1] == plain[plain.index('--weights') + 1] == init


def test_both_modes_draw_the_same_training_images(pair):
    out, _ = pair
    batches = []
    for sync_bn in (True, False):
        solver = get_solver(str(out / 'solver.prototxt'), devices='cpu:4', sync_bn=sync_bn)
        try:
            batches.append([solver.pipeline.next_split() for _ in range(3)])
        finally:
            solver.close()
    for mine, theirs in zip(*batches):
        for rank in range(4):
            for a, b in zip(mine[rank]['data'], theirs[rank]['data']):
                np.testing.assert_array_equal(a, b)


def test_the_precision_runs_differ_in_the_precision_alone_and_snapshot_float32(tmp_path):
    """examples/segmentation/precision.py, a few iterations: each precision trains from the
    one initial weights file with the one solver, and its snapshot is a float32 caffemodel
    (BlobProto.data) that the float32 TEST net scores."""
    data = str(tmp_path / 'data')
    make_dataset.make_dataset(data, train=8, val=4, seed=3)
    results = precision.run(str(tmp_path), data, 5, ['float16', 'bfloat16'],
                            devices=['--cpu-devices', '2'], solver_overrides=TINY_SOLVER,
                            progress=lambda line: None)
    assert list(results) == ['float32', 'float16', 'bfloat16']
    assert json.loads((tmp_path / 'precision.json').read_text()) == results
    def per_run(command):                   # the values of the options that differ
        return [j + 1 for j, word in enumerate(command) if word in ('--precision', '--log-file')]

    def shared(command):
        return [word for j, word in enumerate(command) if j not in per_run(command)]
    for name, result in results.items():
        command = result['command']
        assert command[command.index('--precision') + 1] == name
        assert shared(command) == shared(results['float32']['command'])
    for run in results.values():
        blobs = [b for layer in read_net_param(run['snapshot']).layer for b in layer.blobs]
        assert blobs and all(len(b.data) and not len(b.double_data) for b in blobs)
        assert 0 <= run['mean_iou'] <= 1


def test_the_sweep_reports_mean_and_sample_spread():
    assert sweep.spread([0.1, 0.2, 0.3]) == '0.2000 +- 0.1000 (n=3)'
    runs = {seed: {'syncbn': {'mean_iou': m, 'pixel_accuracy': 0.9},
                   'per-device': {'mean_iou': p, 'pixel_accuracy': 0.8,
                                  'own_statistics_mean_iou': 0.7}}
            for seed, m, p in ((1, 0.8, 0.5), (2, 0.7, 0.3))}
    lines = sweep.summarize(runs)
    assert '  SyncBN - per-device BN    0.3500 +- 0.0707 (n=2)' in lines
    assert '  per-device BN             0.4000 +- 0.1414 (n=2)' in lines


def test_the_memory_plan_fits_more_images_per_device():
    fits = memory_fit.images_per_device()
    (plan_mib, with_plan), (off_mib, without) = fits['auto'], fits['off']
    assert 0 < plan_mib < 0.8 * off_mib and with_plan > without > 0
