"""The command-line tools run as a user runs them: test_net, time_net, plot_log and the
SyncBN overhead benchmark, each as a subprocess, on tiny nets and logs."""
import re
import sys
import textwrap

import numpy as np
import pytest
from helpers import watchdog
from helpers.data_sources import write_sources

from caffe_syncbn.analysis.logparse import parse_lines, read_csv

from helpers.paths import CORPUS, ROOT, require

LIMIT = 120          # seconds a command may take on an idle machine (tests/helpers/watchdog.py)
GLOG = 'I0312 10:00:%02d.000000  4242 %s] %s'


def run_tool(script, *args, cwd=None):
    return watchdog.run([sys.executable, str(ROOT / script)] + [str(a) for a in args],
                        cwd=cwd, capture_output=True, text=True, limit=LIMIT)


def check_ok(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def check_one_error_line(result, *words):
    """A bad input ends the tool with exit 1 and one 'error: ...' line, no traceback."""
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert 'Traceback' not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith('error: '), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


# ---- a tiny classifier with HDF5 data --------------------------------------------------------
FEATURES, CLASSES, ROWS, BATCH = 5, 3, 8, 4


def tiny_net_text(h5_list):
    return textwrap.dedent('''\
        name: "tiny"
        layer { name: "data" type: "HDF5Data" top: "data" top: "label"
                hdf5_data_param { source: "%s" batch_size: %d } }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
                inner_product_param { num_output: %d weight_filler { type: "gaussian" std: 0.5 } } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
        layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" }
        ''' % (h5_list, BATCH, CLASSES))


@pytest.fixture
def tiny(tmp_path):
    """(folder, net prototxt, features, labels) of a tiny net reading an HDF5 file."""
    import h5py
    rng = np.random.RandomState(3)
    x = rng.randn(ROWS, FEATURES).astype(np.float32)
    y = rng.randint(0, CLASSES, ROWS).astype(np.float32)
    with h5py.File(tmp_path / 'data.h5', 'w') as f:
        f['data'], f['label'] = x, y
    (tmp_path / 'data.txt').write_text(str(tmp_path / 'data.h5') + '\n')
    model = tmp_path / 'tiny.prototxt'
    model.write_text(tiny_net_text(tmp_path / 'data.txt'))
    return tmp_path, model, x, y


def logged_values(stderr, pattern):
    return [float(v) for v in re.findall(pattern, stderr)]


def test_test_net_scores_a_saved_caffemodel(tiny):
    from caffe_syncbn import TEST, Net
    folder, model, x, y = tiny
    net = Net(str(model), TEST)
    rng = np.random.RandomState(5)
    weight, bias = rng.randn(CLASSES, FEATURES), rng.randn(CLASSES)
    net.params['ip'][0].data[...] = weight
    net.params['ip'][1].data[...] = bias
    net.save(str(folder / 'tiny.caffemodel'))

    result = check_ok(run_tool('tools/test_net.py', '--model', model, '--weights',
                               folder / 'tiny.caffemodel', '--iterations', 2, '--cpu'))
    scores = x.astype(np.float64) @ weight.T + bias
    log_p = scores - scores.max(1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(1, keepdims=True))
    hit = (scores.argmax(1) == y).reshape(2, BATCH).mean(1)
    loss = -log_p[np.arange(ROWS), y.astype(int)].reshape(2, BATCH).mean(1)
    err = result.stderr
    assert 'Running for 2 iterations.' in err
    np.testing.assert_allclose(logged_values(err, r'Batch \d+, accuracy = (\S+)'), hit, atol=1e-5)
    np.testing.assert_allclose(logged_values(err, r'Batch \d+, loss = (\S+)'), loss, rtol=1e-4)
    np.testing.assert_allclose(logged_values(err, r'\] accuracy = (\S+)'), [hit.mean()], atol=1e-5)
    np.testing.assert_allclose(logged_values(err, r'\] Loss: (\S+)'), [loss.mean()], rtol=1e-4)
    match = re.search(r'\] loss = (\S+) \(\* 1 = (\S+) loss\)', err)
    assert match and np.isclose(float(match.group(1)), loss.mean(), rtol=1e-4), err


def test_test_net_bad_inputs(tiny, tmp_path):
    folder, model, _, _ = tiny
    check_one_error_line(run_tool('tools/test_net.py', '--model', tmp_path / 'missing.prototxt',
                                  '--weights', 'w.caffemodel'), 'missing.prototxt')
    check_one_error_line(run_tool('tools/test_net.py', '--model', model, '--weights',
                                  tmp_path / 'missing.caffemodel'), 'missing.caffemodel')
    broken = tmp_path / 'broken.prototxt'
    broken.write_text('layer { name: "x" type: "Input" top: "x" \n bogus_field: 3 }\n')
    check_one_error_line(run_tool('tools/test_net.py', '--model', broken, '--weights', broken),
                         'broken.prototxt:2')
    other = tmp_path / 'other.caffemodel'        # weights of a different shape
    from caffe_syncbn import TEST, Net
    (tmp_path / 'other.prototxt').write_text(tiny_net_text(folder / 'data.txt')
                                             .replace('num_output: 3', 'num_output: 2'))
    Net(str(tmp_path / 'other.prototxt'), TEST).save(str(other))
    check_one_error_line(run_tool('tools/test_net.py', '--model', model, '--weights', other), 'ip')


# ---- time_net ----------------------------------------------------------------------------------
def test_time_net_on_lenet():
    model = require(CORPUS / 'BVLC_caffe__examples_mnist_lenet_train_test.prototxt')
    result = check_ok(run_tool('tools/time_net.py', '--model', model, '--batch', 2,
                               '--iterations', 2, '--input-shape', '1,1,28,28'))
    err = result.stderr             # caffe time's lines, in the log
    for layer in ('conv1', 'pool1', 'ip2', 'loss'):
        for way in ('forward', 'backward'):
            assert re.search(r'\] +%s\t%s: [\d.e-]+ ms\.$' % (layer, way), err, re.M), err
    assert len(re.findall(r'\] Iteration: [12] forward-backward time: [\d.e-]+ ms\.$', err, re.M)) == 2
    for line in ('Average Forward pass', 'Average Backward pass', 'Average Forward-Backward',
                 'Total Time'):
        assert re.search(r'\] %s: [\d.e-]+ ms\.$' % line, err, re.M), err


def test_timing_nets_take_the_batch_also_for_input_layers(tmp_path, monkeypatch):
    from caffe_syncbn.analysis.timing import build_timing_net
    model = require(CORPUS / 'BVLC_caffe__examples_mnist_lenet.prototxt')   # an Input layer
    assert build_timing_net(str(model), batch=3).blobs['data'].shape == (3, 1, 28, 28)
    model = require(CORPUS / 'BVLC_caffe__examples_mnist_lenet_train_test.prototxt')
    monkeypatch.chdir(tmp_path)             # where the prototxt's LMDBs are written
    write_sources(model, (1, 28, 28))
    assert build_timing_net(str(model), batch=3).blobs['data'].shape == (3, 1, 28, 28)


def test_time_net_bad_inputs(tmp_path):
    check_one_error_line(run_tool('tools/time_net.py', '--model', tmp_path / 'nope.prototxt'),
                         'nope.prototxt')
    broken = tmp_path / 'broken.prototxt'
    broken.write_text('layer { name: "x" type: "Input" top: "x"\n')
    check_one_error_line(run_tool('tools/time_net.py', '--model', broken), 'broken.prototxt')


# ---- plot_log ----------------------------------------------------------------------------------
def synthetic_caffe_log():
    """Lines as BVLC Caffe's glog output has them (with its iter/s part and a vector output)."""
    lines = ['Log file created at: 2024/03/12 10:00:00',
             GLOG % (0, 'solver.cpp:330', 'Iteration 0, Testing net (#0)'),
             GLOG % (0, 'solver.cpp:397', '    Test net output #0: accuracy = 0.1'),
             GLOG % (0, 'solver.cpp:397', '    Test net output #1: loss = 2.3 (* 1 = 2.3 loss)')]
    for it, (loss, lr) in enumerate([(2.31, 0.01), (1.2, 0.01), (0.6, 0.001)]):
        lines += [GLOG % (it + 1, 'solver.cpp:218',
                          'Iteration %d (98.1 iter/s, 1.02s/100 iters), loss = %g' % (it * 100, loss)),
                  GLOG % (it + 1, 'solver.cpp:237',
                          '    Train net output #0: loss = %g (* 1 = %g loss)' % (loss, loss)),
                  GLOG % (it + 1, 'sgd_solver.cpp:105', 'Iteration %d, lr = %g' % (it * 100, lr))]
    lines += [GLOG % (9, 'solver.cpp:330', 'Iteration 300, Testing net (#0)'),
              GLOG % (9, 'solver.cpp:397', '    Test net output #0: accuracy = 0.9'),
              GLOG % (9, 'solver.cpp:397', '    Test net output #1: loss = 0.4 (* 1 = 0.4 loss)'),
              GLOG % (9, 'solver.cpp:330', 'Iteration 300, Testing net (#1)'),
              GLOG % (9, 'solver.cpp:397', '    Test net output #0: per_class = 0.5'),
              GLOG % (9, 'solver.cpp:397', '    Test net output #1: per_class = 0.75'),
              GLOG % (9, 'solver.cpp:218', 'Iteration 300, loss = nan')]
    return lines


def test_parse_lines_reads_caffe_glog_output():
    train, test = parse_lines(synthetic_caffe_log())
    assert [r['iteration'] for r in train] == [0, 100, 200, 300]
    assert [r['loss'] for r in train[:3]] == [2.31, 1.2, 0.6] and np.isnan(train[3]['loss'])
    assert [r.get('lr') for r in train] == [0.01, 0.01, 0.001, None]
    assert test == [{'iteration': 0, 'accuracy': 0.1, 'loss': 2.3},
                    {'iteration': 300, 'accuracy': 0.9, 'loss': 0.4},
                    {'iteration': 300, 'net1_per_class': 0.5, 'net1_per_class_1': 0.75}]


def test_plot_log_writes_csv_and_png(tmp_path):
    log = tmp_path / 'caffe.INFO'
    log.write_text('\n'.join(synthetic_caffe_log()) + '\n')
    result = check_ok(run_tool('tools/plot_log.py', log, '--output-dir', tmp_path / 'out'))
    assert '4 train rows, 3 test rows' in result.stdout
    train = read_csv(tmp_path / 'out' / 'caffe.INFO.train.csv')
    assert [r['iteration'] for r in train] == [0, 100, 200, 300]
    assert train[2] == {'iteration': 200, 'loss': 0.6, 'lr': 0.001} and train[3]['lr'] is None
    test = read_csv(tmp_path / 'out' / 'caffe.INFO.test.csv')
    assert list(test[0]) == ['iteration', 'accuracy', 'loss', 'net1_per_class', 'net1_per_class_1']
    assert test[1]['accuracy'] == 0.9 and test[2]['net1_per_class_1'] == 0.75
    png = (tmp_path / 'out' / 'caffe.INFO.png').read_bytes()
    assert png.startswith(b'\x89PNG') and len(png) > 10000
    assert not [p for p in (tmp_path / 'out').iterdir() if p.name.endswith('.tmp')]


def test_plot_log_bad_inputs(tmp_path):
    check_one_error_line(run_tool('tools/plot_log.py', tmp_path / 'none.log'), 'none.log')
    other = tmp_path / 'notes.txt'
    other.write_text('nothing to see here\n')
    check_one_error_line(run_tool('tools/plot_log.py', other), 'notes.txt')


def test_plot_log_on_a_training_run(tiny):
    """train_net.py on 2 virtual devices writes a log that plot_log turns into tables."""
    folder, model, _, _ = tiny
    solver = folder / 'solver.prototxt'
    solver.write_text(textwrap.dedent('''\
        net: "%s"
        test_iter: 2  test_interval: 5  display: 2  max_iter: 10
        base_lr: 0.1  lr_policy: "step"  gamma: 0.5  stepsize: 4  momentum: 0.9
        snapshot_prefix: "%s"  random_seed: 7
        ''' % (model, folder / 'tiny')))
    log = folder / 'train.log'
    check_ok(run_tool('tools/train_net.py', '--solver', solver, '--cpu-devices', 2,
                      '--log-file', log, cwd=folder))
    check_ok(run_tool('tools/plot_log.py', log))
    train = read_csv(folder / 'train.log.train.csv')
    # iteration 10 is the display pass after the last update, as in `caffe train`: no lr line
    assert [r['iteration'] for r in train] == [0, 2, 4, 6, 8, 10]
    assert [r['lr'] for r in train[:5]] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])
    assert all(np.isfinite(r['loss']) for r in train)
    test = read_csv(folder / 'train.log.test.csv')
    assert [r['iteration'] for r in test] == [0, 5, 10]
    assert all(0 <= r['accuracy'] <= 1 and r['loss'] > 0 for r in test)
    assert (folder / 'train.log.png').stat().st_size > 10000


# ---- the benchmark -----------------------------------------------------------------------------
def test_syncbn_overhead_quick():
    result = check_ok(run_tool('benchmarks/syncbn_overhead.py', '--quick'))
    out = result.stdout
    ratio = re.search(r'SyncBN / BN step time: ([\d.]+)x', out)
    assert ratio and float(ratio.group(1)) > 0, out
    rows = re.findall(r'^ +([124]) +([\d.]+) +([\d.]+) +([\d.]+)x$', out, re.MULTILINE)
    assert [r[0] for r in rows] == ['1', '2', '4'], out
    assert float(rows[0][3]) == 1.0


def test_real_prototxts_counts_what_runs_and_names_what_stops(tmp_path):
    """benchmarks/real_prototxts.py on two of its nets: BVLC's SRCNN runs, NVCaffe's
    DetectNet stops with one line naming its fork; the table says so."""
    result = check_ok(run_tool('benchmarks/real_prototxts.py', '--out', tmp_path, '--label',
                               'smoke', 'SRCNN_deploy', 'kitti_detectnet'))
    assert result.stdout.strip().splitlines()[-1].startswith('1 of 2 ran'), result.stdout
    rows = [line.split('\t') for line in
            (tmp_path / 'results_smoke.tsv').read_text().splitlines()[1:]]
    results = {name.split('__')[0]: (result, line) for name, _, _, result, line in rows}
    assert results['SolessChong_srcnn-caffe'][0] == 'OK'
    assert results['NVIDIA_caffe'][0] == 'ERROR' and 'NVCaffe' in results['NVIDIA_caffe'][1]


def test_syncbn_overhead_bad_batch():
    check_one_error_line(run_tool('benchmarks/syncbn_overhead.py', '--quick', '--batch', 6),
                         'multiple of 4')
