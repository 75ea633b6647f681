"""PreciseBN (training/precise_bn.py) against the exact population statistics: float64
numpy over the same K global batches, each batch norm's input computed with the batch
norms before it on their new statistics; on 1 device and on 4 (every replica bitwise
alike), in BatchNorm's sums and the momentum form; and its command's one-line errors."""
import os
import shutil
import sys
import textwrap

import h5py
import numpy as np
import pytest
from helpers import watchdog
from helpers.emulated_gpu import emulated_gpu
from helpers.paths import ROOT

from caffe_syncbn import TEST, TRAIN, Net
from caffe_syncbn.backend import to_numpy
from caffe_syncbn.cli.commands import main
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.fillers import set_random_seed
from caffe_syncbn.training.precise_bn import PreciseBN
from caffe_syncbn.weights.norm_forms import statistics_factor

GLOBAL_BATCH, BATCHES, EPS = 4, 5, 1e-5
CHANNELS = {'conv1': (3, 4), 'conv2': (4, 5), 'short': (4, 5), 'conv3': (5, 5)}

#: batch norm forms: how each prototxt writes one (NAME, BOTTOM, TOP), whether its
#: variance is unbiased, and whether it keeps BatchNorm's sums
FORMS = {
    'BatchNorm': ('layer { name: "NAME" type: "BatchNorm" bottom: "BOTTOM" top: "TOP" }\n'
                  'layer { name: "NAME_scale" type: "Scale" bottom: "TOP" top: "TOP" '
                  'scale_param { bias_term: true } }', True, True),
    'BN': ('layer { name: "NAME" type: "BN" bottom: "BOTTOM" top: "TOP" '
           'bn_param { momentum: 0.9 } }', False, False),
    'SyncBN': ('layer { name: "NAME" type: "SyncBN" bottom: "BOTTOM" top: "TOP" }',
               True, False),
    'SyncBN-sums': ('layer { name: "NAME" type: "SyncBN" bottom: "BOTTOM" top: "TOP" '
                    'bn_param { statistics: BATCHNORM momentum: 0.99 } }', True, True),
    'NVCaffe': ('layer { name: "NAME" type: "BatchNorm" bottom: "BOTTOM" top: "TOP" '
                'batch_norm_param { scale_bias: true } }', True, False),
}
#: where a form's own blobs hold (mean, var) and (slope, bias), if not in BN's order
NVCAFFE_LAYOUT = {'NVCaffe': ((0, 1), (3, 4))}


def conv(name, bottom, top=None):
    return ('layer { name: "%s" type: "Convolution" bottom: "%s" top: "%s" '
            'convolution_param { num_output: %d kernel_size: 3 pad: 1 '
            'weight_filler { type: "gaussian" std: 0.4 } bias_filler { type: "gaussian" '
            'std: 1 } } }' % (name, bottom, top or name, CHANNELS[name][1]))


def norm(form, name, bottom, top):
    return FORMS[form][0].replace('NAME', name).replace('BOTTOM', bottom).replace('TOP', top)


def net_text(form, source, batch):
    """conv1-bn1-relu, then conv2-bn2-relu-conv3-bn3 beside a shortcut conv-bn_short that
    reads conv1 too (bn2 and bn_short share a pass), summed: a ResNet block in small."""
    return '\n'.join([
        'name: "precise"',
        'layer { name: "data" type: "HDF5Data" top: "data" '
        'hdf5_data_param { source: "%s" batch_size: %d } }' % (source, batch),
        conv('conv1', 'data'), norm(form, 'bn1', 'conv1', 'conv1'),
        'layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }',
        conv('conv2', 'conv1'), norm(form, 'bn2', 'conv2', 'conv2'),
        'layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }',
        conv('short', 'conv1'), norm(form, 'bn_short', 'short', 'short_bn'),
        conv('conv3', 'conv2'), norm(form, 'bn3', 'conv3', 'bn3'),
        'layer { name: "sum" type: "Eltwise" bottom: "bn3" bottom: "short_bn" top: "sum" }'])


@pytest.fixture(scope='module')
def rows(tmp_path_factory):
    """K global batches of rows in one HDF5 file, read in order: the K batches are all of
    them. Returns (list file, the rows)."""
    folder = tmp_path_factory.mktemp('precise_rows')
    data = np.random.RandomState(5).standard_normal((GLOBAL_BATCH * BATCHES, 3, 6, 5)) * 2 + 1
    with h5py.File(folder / 'rows.h5', 'w') as f:
        f['data'] = data
    (folder / 'list.txt').write_text(str(folder / 'rows.h5') + '\n')
    return str(folder / 'list.txt'), data


def write_model(folder, form, source, devices):
    """The prototxt of ``form`` at GLOBAL_BATCH / devices per device, and weights with
    random running statistics, slopes and biases (the convolutions' fillers)."""
    model = os.path.join(str(folder), '%s-%d.prototxt' % (form, devices))
    with open(model, 'w') as f:
        f.write(net_text(form, source, GLOBAL_BATCH // devices))
    weights = os.path.join(str(folder), '%s.caffemodel' % form)
    if not os.path.exists(weights):
        rs = np.random.RandomState(11)
        set_random_seed(11)               # the convolutions' fillers: the same weights in every run
        net = Net(model, TRAIN)
        for layer in net.layers:
            for blob in layer.blobs:
                if layer.type != 'Convolution':
                    blob.data[...] = rs.uniform(0.5, 2.0, blob.shape)
        net.save(weights)
    return model, weights


def conv_numpy(x, weight, bias):
    """A 3x3 convolution of padding 1, in float64."""
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    height, width = x.shape[2:]
    out = np.zeros((x.shape[0], weight.shape[0], height, width))
    for dy in range(3):
        for dx in range(3):
            window = padded[:, :, dy:dy + height, dx:dx + width]
            out += np.einsum('nchw,oc->nohw', window, weight[:, :, dy, dx])
    return out + bias.reshape(1, -1, 1, 1)


def reference(weights_net, data, unbiased, form=None):
    """{batch norm: (mean, variance as the layer keeps it)} of the exact population over
    all rows, each batch norm's input made with the earlier ones' new statistics; and the
    output of the net in TEST with them."""
    params = {name: [np.asarray(b.data, np.float64) for b in blobs]
              for name, blobs in weights_net.params.items()}
    found = {}

    def normalize(name, x):
        mean = x.mean(axis=(0, 2, 3))
        var = x.var(axis=(0, 2, 3), ddof=1 if unbiased else 0)
        found[name] = mean, var
        x_hat = (x - mean.reshape(1, -1, 1, 1)) / np.sqrt(var + EPS).reshape(1, -1, 1, 1)
        slope_at, bias_at = NVCAFFE_LAYOUT[form][1] if form in NVCAFFE_LAYOUT else (0, 1)
        affine = params.get(name + '_scale') or (params[name][slope_at], params[name][bias_at])
        return x_hat * affine[0].reshape(1, -1, 1, 1) + affine[1].reshape(1, -1, 1, 1)

    convolve = lambda name, x: conv_numpy(x, *params[name])  # noqa: E731
    y1 = np.maximum(normalize('bn1', convolve('conv1', data)), 0)
    y2 = np.maximum(normalize('bn2', convolve('conv2', y1)), 0)
    short = normalize('bn_short', convolve('short', y1))
    return found, normalize('bn3', convolve('conv3', y2)) + short


def stored_statistics(layer, sums, form=None):
    """(mean, variance) as TEST reads them from a layer's blobs, and the factor s."""
    blobs = [np.asarray(b.data, np.float64).ravel() for b in layer.blobs]
    if sums:
        factor = blobs[-1][0]
        return blobs[-3] / factor, blobs[-2] / factor, factor
    mean_at, var_at = NVCAFFE_LAYOUT[form][0] if form in NVCAFFE_LAYOUT else (2, 3)
    return blobs[mean_at], blobs[var_at], None


@pytest.mark.parametrize('form', sorted(FORMS))
@pytest.mark.parametrize('devices', [1, 4])
def test_statistics_are_the_exact_population_of_each_layers_input(tmp_path, rows, form, devices):
    source, data = rows
    model, weights = write_model(tmp_path, form, source, devices)
    _, unbiased, sums = FORMS[form]
    with PreciseBN(model, [weights], devices='cpu:%d' % devices, dtype=np.float64) as job:
        assert [[job.net.layers[i].name for i in group] for group in job.passes] == \
            [['bn1'], ['bn2', 'bn_short'], ['bn3']]
        job.estimate(BATCHES)
        expected, _ = reference(job.net, data, unbiased, form)
        for name, (mean, var) in expected.items():
            stored = [stored_statistics(net.layer_dict[name], sums, form) for net in job.nets]
            np.testing.assert_allclose(stored[0][0], mean, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(stored[0][1], var, rtol=1e-12)
            if sums:      # Caffe's s once trained to its fraction's end, a power of two
                fraction = job.net.layer_dict[name].statistics.fraction
                assert stored[0][2] == statistics_factor(fraction) > 1
            for other in job.nets[1:]:    # every replica holds the same bits
                for mine, theirs in zip(job.nets[0].params[name], other.params[name]):
                    assert np.array_equal(mine.data, theirs.data)


def test_the_written_file_scores_test_as_the_population_statistics_do(tmp_path, rows):
    """The output caffemodel, in a TEST net of the same prototxt, gives the reference net
    on the exact statistics (float32 blobs: within float32 rounding)."""
    source, data = rows
    model, weights = write_model(tmp_path, 'BatchNorm', source, 4)
    output = str(tmp_path / 'out.caffemodel')
    assert main(['precise_bn', '-model', model, '-weights', weights, '-output', output,
                 '-iterations', str(BATCHES), '-cpu_devices', '4']) == 0
    net = Net(model, TEST, weights=output, dtype=np.float64)
    expected_stats, expected_output = reference(net, data, unbiased=True)
    outputs = [np.array(net.forward()['sum']) for _ in range(len(data))]    # batch 1
    np.testing.assert_allclose(np.concatenate(outputs), expected_output, rtol=2e-5, atol=2e-5)
    before = Net(model, TEST, weights=weights)
    for name in expected_stats:
        assert not np.allclose(stored_statistics(before.layer_dict[name], True)[0],
                               expected_stats[name][0], rtol=1e-3)


def test_the_statistics_differ_from_one_pass_that_normalizes_by_batch(tmp_path, rows):
    """Estimated all at once from passes on batch statistics (PreciseBN of the anchors),
    bn3's input is another one: the layer-by-layer order is what the test above checks."""
    source, data = rows
    model, weights = write_model(tmp_path, 'SyncBN', source, 1)
    with PreciseBN(model, [weights], dtype=np.float64) as job:
        job.estimate(BATCHES)
        exact = stored_statistics(job.net.layer_dict['bn3'], False)[1]
    net = Net(model, TRAIN, weights=weights, dtype=np.float64)
    variances = []
    for _ in range(BATCHES):
        net.forward()
        variances.append(np.asarray(net.blobs['conv3'].data).var(axis=(0, 2, 3), ddof=1))
    assert not np.allclose(np.mean(variances, axis=0), exact, rtol=1e-2)


def test_random_layers_draw_the_same_masks_in_every_pass(tmp_path, rows):
    """bn_c reads the Dropout's output, as bn_a does, but in the next pass (after bn_b,
    which depends on bn_a): the same K batches and masks give it bn_a's statistics."""
    source, _ = rows
    model = tmp_path / 'dropout.prototxt'
    model.write_text(textwrap.dedent('''\
        layer { name: "data" type: "HDF5Data" top: "data"
                hdf5_data_param { source: "%s" batch_size: 2 } }
        layer { name: "drop" type: "Dropout" bottom: "data" top: "drop" }
        layer { name: "bn_a" type: "SyncBN" bottom: "drop" top: "a" }
        layer { name: "bn_b" type: "SyncBN" bottom: "a" top: "b" }
        layer { name: "bn_c" type: "SyncBN" bottom: "drop" top: "c" }
        ''') % source)
    Net(str(model), TRAIN).save(str(tmp_path / 'w.caffemodel'))
    with PreciseBN(str(model), [str(tmp_path / 'w.caffemodel')], devices='cpu:2') as job:
        assert [[job.net.layers[i].name for i in g] for g in job.passes] == \
            [['bn_a'], ['bn_b', 'bn_c']]
        job.estimate(BATCHES)
        params = job.net.params
        assert np.array_equal(params['bn_a'][2].data, params['bn_c'][2].data)
        assert np.array_equal(params['bn_a'][3].data, params['bn_c'][3].data)
        assert not np.array_equal(params['bn_a'][3].data, params['bn_b'][3].data)


# ---- the command's errors --------------------------------------------------------------------
def run_command(*argv):
    try:
        main(['precise_bn'] + list(argv))
    except CaffeError as exc:
        return str(exc)
    raise AssertionError('no error')


def test_bad_input_is_one_line(tmp_path, rows):
    source, _ = rows
    model, weights = write_model(tmp_path, 'BatchNorm', source, 1)
    output = str(tmp_path / 'out.caffemodel')
    cases = {'-iterations 0': ['-iterations', '0'],
             'a missing output folder': ['-output', str(tmp_path / 'nowhere' / 'x.caffemodel')]}
    for what, extra in cases.items():
        argv = ['-model', model, '-weights', weights, '-output', output] + extra
        message = run_command(*argv)
        assert '\n' not in message, what
    assert 'expected a number of iterations >= 1' in run_command(
        '-model', model, '-weights', weights, '-output', output, '-iterations', '0')
    assert 'nowhere' in run_command('-model', model, '-weights', weights, '-output',
                                    str(tmp_path / 'nowhere' / 'x.caffemodel'))
    with pytest.raises(CaffeError, match='at least 1 global batch'):
        with PreciseBN(model, [weights]) as job:
            job.estimate(0)

    no_norm = tmp_path / 'no_norm.prototxt'
    no_norm.write_text(net_text('BatchNorm', source, 1).replace('BatchNorm', 'ReLU')
                       .replace('Scale', 'ReLU').replace('scale_param { bias_term: true }', ''))
    message = run_command('-model', str(no_norm), '-weights', weights, '-output', output)
    assert "has no batch norm (BatchNorm, BN, SyncBN)" in message and str(no_norm) in message

    frozen = tmp_path / 'frozen.prototxt'
    frozen.write_text(net_text('BatchNorm', source, 1).replace(
        'type: "BatchNorm"', 'type: "BatchNorm" batch_norm_param { use_global_stats: true }'))
    assert '(4 frozen)' in run_command('-model', str(frozen), '-weights', weights,
                                        '-output', output)

    segnet = tmp_path / 'segnet.prototxt'      # SegNet's BN: scale and shift, no statistics
    segnet.write_text(net_text('BN', source, 1).replace('momentum: 0.9', 'bn_mode: LEARN'))
    Net(str(segnet), TRAIN).save(str(tmp_path / 'segnet.caffemodel'))
    message = run_command('-model', str(segnet), '-weights', str(tmp_path / 'segnet.caffemodel'),
                          '-output', output)
    assert "(4 SegNet's BN, which keep no running statistics)" in message, message

    overflowing = Net(model, TRAIN, weights=weights)
    overflowing.params['conv2'][0].data[...] = 3e38
    overflowing.save(str(tmp_path / 'overflowing.caffemodel'))
    message = run_command('-model', model, '-weights', str(tmp_path / 'overflowing.caffemodel'),
                          '-output', output)
    assert "the input of layer 'bn2' is not finite over 200 global batches (channel 0 of 5" \
        in message

    inputs = tmp_path / 'inputs.prototxt'
    inputs.write_text(net_text('BatchNorm', source, 1).replace(
        'type: "HDF5Data" top: "data" hdf5_data_param { source: "%s" batch_size: 1 }' % source,
        'type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 6 dim: 5 } }'))
    message = run_command('-model', str(inputs), '-weights', weights, '-output', output)
    assert 'has no data layer' in message and str(inputs) in message
    assert not os.path.exists(output)


# ---- across processes ------------------------------------------------------------------------
MPIEXEC = shutil.which('mpiexec', path=os.path.dirname(sys.executable) + os.pathsep +
                       os.environ.get('PATH', ''))


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found: pip install '.[mpi]'")
def test_two_processes_of_two_devices_write_the_file_of_one_process_of_four(tmp_path, rows):
    """The sums of every replica meet in global rank order: mpiexec -n 2 with 2 devices each
    writes bitwise the file of one process of 4 devices."""
    source, _ = rows
    model, weights = write_model(tmp_path, 'BatchNorm', source, 4)
    command = ['precise_bn', '-model', model, '-weights', weights, '-iterations', str(BATCHES)]
    one = str(tmp_path / 'one.caffemodel')
    assert main(command + ['-output', one, '-cpu_devices', '4']) == 0
    two = str(tmp_path / 'two.caffemodel')
    result = watchdog.run([MPIEXEC, '-n', '2', sys.executable, '-m', 'caffe_syncbn'] + command +
                          ['-output', two, '-cpu_devices', '2'], limit=60, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'Process 0 of 2 (MPI): replicas 0 to 1 of 4' in result.stderr
    with open(one, 'rb') as a, open(two, 'rb') as b:
        assert a.read() == b.read()


# ---- the GPU path, on the emulation of the CUDA runtime --------------------------------------
@pytest.mark.parametrize('devices', ['gpu:0,1', 'gpu:0,0'])
def test_the_gpu_path_gives_the_statistics_of_the_cpu(monkeypatch, tmp_path, rows, devices):
    """The CUDA engine's sums, the device communicators and every hand-over between the
    replicas' streams (which the emulation holds to a GPU's order) give the CPU's numbers."""
    source, _ = rows
    model, weights = write_model(tmp_path, 'BatchNorm', source, 2)
    found = {}
    for where in ('cpu:2', devices):
        if where.startswith('gpu'):
            emulated_gpu(monkeypatch)
        with PreciseBN(model, [weights], devices=where) as job:
            job.estimate(BATCHES)
            found[where] = [[to_numpy(blob.data) for blob in net.params['bn3']] for net in job.nets]
    for mine, theirs in zip(found['cpu:2'][0], found[devices][0]):
        np.testing.assert_allclose(theirs, mine, rtol=1e-5)
    assert all(np.array_equal(a, b) for a, b in zip(*found[devices]))


# ---- the demo's figure -------------------------------------------------------------------------
@pytest.mark.slow
def test_the_demo_script_scores_each_run_before_and_after(tmp_path):
    """examples/segmentation/precise_bn_gain.py on a pair of 4-iteration demo runs: the
    command writes new statistics beside each snapshot, which the script scores, and so
    does the anchors' average of batch statistics."""
    pytest.importorskip('cv2')
    sys.path.insert(0, str(ROOT / 'examples' / 'segmentation'))
    import compare
    import make_dataset
    import precise_bn_gain
    data = str(tmp_path / 'data')
    make_dataset.make_dataset(data, train=8, val=4, seed=3)
    pair = compare.run_pair(str(tmp_path), data, seed=5, devices=['--cpu-devices', '2'],
                            solver_overrides={'max_iter': 4, 'test_interval': 4, 'test_iter': 1},
                            progress=lambda line: None)
    for run in pair.values():
        after = precise_bn_gain.precise(run, str(tmp_path / 'fcn_bn.prototxt'), 2,
                                        ['--cpu-devices', '2'], 4)
        assert 0 <= after['mean_iou'] <= 1 and 0 <= after['pixel_accuracy'] <= 1
        trained, precise = (Net(str(tmp_path / 'fcn_bn.prototxt'), TEST, weights=path)
                            for path in (run['snapshot'], after['weights']))
        assert not np.array_equal(trained.params['conv1_bn'][0].data,
                                  precise.params['conv1_bn'][0].data)
        assert np.array_equal(trained.params['conv1'][0].data, precise.params['conv1'][0].data)
        average = precise_bn_gain.batch_average(run, str(tmp_path / 'fcn_bn.prototxt'), 4, 2, 4)
        assert 0 <= average['mean_iou'] <= 1
