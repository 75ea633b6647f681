"""tools/train_net.py end to end, as a user runs it: subprocesses, files, signals."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import watchdog

import caffe_syncbn as caffe

ROOT = Path(__file__).resolve().parents[1]
TRAIN_NET = ROOT / 'tools' / 'train_net.py'

NET = '''name: "tiny"
layer { name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "%(list)s" batch_size: %(batch)d } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''

SOLVER = '''net: "%(net)s"
base_lr: 0.05 momentum: 0.9 lr_policy: "fixed" max_iter: %(max_iter)d display: 1
random_seed: 3 snapshot_prefix: "%(prefix)s" snapshot_after_train: true
'''


LMDB_DATA = '''layer { name: "data" type: "Data" top: "data" top: "label"
        data_param { source: "%(db)s" backend: LMDB batch_size: %(batch)d }
        transform_param { scale: 0.02 mean_value: 120 } }
'''


def make_job(folder, batch, max_iter=3, rows=48, source='hdf5'):
    """A tiny conv-BatchNorm-Scale net reading ``rows`` samples from HDF5 or an LMDB."""
    folder.mkdir(parents=True, exist_ok=True)
    rs = np.random.RandomState(0)
    images = rs.randint(0, 256, (rows, 2, 5, 5)).astype(np.uint8)
    labels = rs.randint(0, 3, rows)
    with h5py.File(folder / 'data.h5', 'w') as f:
        f['data'] = (images.astype(np.float32) - 120) * 0.02
        f['label'] = labels.astype(np.float32)
    (folder / 'list.txt').write_text(str(folder / 'data.h5') + '\n')
    net = NET % {'list': folder / 'list.txt', 'batch': batch}
    if source == 'lmdb':
        from caffe_syncbn.data.datum import array_to_datum, write_lmdb
        records = [(b'%08d' % i, array_to_datum(image, int(label)).SerializeToString())
                   for i, (image, label) in enumerate(zip(images, labels))]
        write_lmdb(str(folder / 'db'), [records])
        net = net.replace(net[net.index('layer {'):net.index('layer { name: "conv"')],
                          LMDB_DATA % {'db': folder / 'db', 'batch': batch})
    (folder / 'net.prototxt').write_text(net)
    solver = folder / 'solver.prototxt'
    solver.write_text(SOLVER % {'net': folder / 'net.prototxt', 'max_iter': max_iter,
                                'prefix': folder / 'snap'})
    return solver


def run_tool(*args, limit=120):
    return watchdog.run([sys.executable, str(TRAIN_NET), *map(str, args)], capture_output=True,
                        text=True, limit=limit, cwd=ROOT)


def params_of(path, prototxt):
    net = caffe.Net(str(prototxt), caffe.TEST, weights=str(path))
    return {k: [b.data.copy() for b in v] for k, v in net.params.items()}


def logged_losses(stderr):
    """{iteration: loss} of the 'Iteration N, loss = x' lines."""
    import re
    return {int(i): float(x) for i, x in re.findall(r'Iteration (\d+), loss = (\S+)', stderr)}


def test_displayed_loss_is_the_mean_of_the_last_average_loss_iterations(tmp_path):
    """Caffe's smoothed loss runs over the whole training, not one step at a time."""
    raw_job = make_job(tmp_path / 'raw', batch=4, max_iter=8)
    smooth_job = make_job(tmp_path / 'smooth', batch=4, max_iter=8)
    smooth_job.write_text(smooth_job.read_text() + 'average_loss: 3\n')
    raw, smooth = run_tool('--solver', raw_job), run_tool('--solver', smooth_job)
    assert raw.returncode == 0 and smooth.returncode == 0, raw.stderr + smooth.stderr
    raw, smooth = logged_losses(raw.stderr), logged_losses(smooth.stderr)
    assert len(set(raw[i] for i in range(8))) > 1
    for i in range(8):
        window = [raw[j] for j in range(max(0, i - 2), i + 1)]
        assert smooth[i] == pytest.approx(np.mean(window), rel=1e-5), (i, raw, smooth)


@pytest.mark.parametrize('source', ['lmdb', 'hdf5'])
def test_four_devices_with_sync_bn_equal_one_device(tmp_path, source):
    """The real pipeline: one reader draws 4 x 4 samples and splits them over 4 devices."""
    four = make_job(tmp_path / 'four', batch=4, source=source)
    one = make_job(tmp_path / 'one', batch=16, source=source)
    a = run_tool('--solver', four, '--cpu-devices', 4, '--sync-bn')
    assert a.returncode == 0, a.stderr
    b = run_tool('--solver', one, '--cpu-devices', 1, '--sync-bn')
    assert b.returncode == 0, b.stderr
    assert 'Iteration 0, loss = ' in a.stderr and 'Optimization Done.' in a.stderr
    from caffe_syncbn.convert import to_syncbn
    converted, _ = to_syncbn(str(tmp_path / 'four' / 'net.prototxt'))
    net_four = caffe.Net(converted, caffe.TEST, weights=str(tmp_path / 'four' / 'snap_iter_3.caffemodel'))
    net_one = caffe.Net(converted, caffe.TEST, weights=str(tmp_path / 'one' / 'snap_iter_3.caffemodel'))
    for name, blobs in net_one.params.items():
        for mine, theirs in zip(net_four.params[name], blobs):
            np.testing.assert_allclose(mine.data, theirs.data, atol=1e-5, rtol=1e-5)


def test_sigint_with_snapshot_effect_writes_a_snapshot_and_exits_0(tmp_path):
    solver = make_job(tmp_path, batch=4, max_iter=60)
    proc = subprocess.Popen([sys.executable, str(TRAIN_NET), '--solver', str(solver),
                             '--sigint-effect', 'snapshot'], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:                     # wait until training runs
        seen.append(line)
        if 'Iteration 2, loss' in line:
            proc.send_signal(signal.SIGINT)
            break
    seen += proc.stderr.readlines()
    assert watchdog.wait(proc, limit=120) == 0, ''.join(seen)
    snapshots = sorted(p.name for p in tmp_path.glob('snap_iter_*.caffemodel'))
    assert any(name != 'snap_iter_60.caffemodel' for name in snapshots), snapshots
    assert 'snap_iter_60.caffemodel' in snapshots


def test_kill_during_snapshot_leaves_previous_snapshot_loadable(tmp_path):
    """SIGKILL a process that keeps rewriting a large caffemodel; the file stays whole."""
    script = tmp_path / 'writer.py'
    target = tmp_path / 'big.caffemodel'
    script.write_text('''
import sys, numpy as np
sys.path.insert(0, %r)
import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from google.protobuf import text_format
p = text_format.Parse('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 4 } } }'
                      'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
                      'inner_product_param { num_output: 6000000 } }', caffe_pb2.NetParameter())
net = caffe.Net(p, caffe.TEST)
net.save(%r)
print('first', flush=True)
while True:
    net.params['ip'][0].data[...] += 1
    net.save(%r)
''' % (str(ROOT), str(target), str(target)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == 'first'
    time.sleep(1.5)                              # several saves are under way by now
    proc.send_signal(signal.SIGKILL)
    watchdog.wait(proc, limit=30)
    from caffe_syncbn.formats.caffemodel import read_net_param
    param = read_net_param(str(target))          # whole and parseable
    weights = [l for l in param.layer if l.name == 'ip'][0].blobs[0]
    assert len(weights.data) == 6000000 * 4


@pytest.mark.parametrize('case', ['missing solver', 'missing net', 'gpu without gpu', 'bad weights',
                                  'missing data'])
def test_bad_input_gives_one_clear_error_line(tmp_path, case):
    solver = make_job(tmp_path, batch=4)
    args = ['--solver', solver]
    if case == 'missing solver':
        args = ['--solver', tmp_path / 'nope.prototxt']
    elif case == 'missing net':
        (tmp_path / 'net.prototxt').unlink()
    elif case == 'gpu without gpu':
        if caffe.backend.gpu_count():
            pytest.skip('this machine has a GPU')
        args += ['--gpus', '0']
    elif case == 'bad weights':
        bad = tmp_path / 'other.prototxt'
        bad.write_text((tmp_path / 'net.prototxt').read_text().replace('num_output: 4', 'num_output: 5'))
        net = caffe.Net(str(bad), caffe.TRAIN)
        net.save(str(tmp_path / 'bad.caffemodel'))
        args += ['--weights', tmp_path / 'bad.caffemodel']
    elif case == 'missing data':
        (tmp_path / 'list.txt').write_text(str(tmp_path / 'absent.h5') + '\n')
    result = run_tool(*args)
    assert result.returncode != 0
    assert 'Traceback' not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
    assert len(errors) == 1, result.stderr
    expected = {'missing solver': 'nope.prototxt', 'missing net': 'net.prototxt', 'gpu without gpu': 'GPU',
                'bad weights': 'conv', 'missing data': 'absent.h5'}[case]
    assert expected in errors[0]
