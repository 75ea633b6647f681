"""The segmentation forks' layers held to the forks' own Caffe: the goldens of
tests/fork_golden (SegNet's and DeepLab v2's; each folder's README.md: how tools/forks/ made
them) replayed through a Net from the same prototxt, the fork's caffemodel and the same inputs,
and each case's layer alone on every engine, forward and backward at float32 tolerances. The
forks' gradients are themselves held to central differences in float64 (through our Net, whose
forward the replay holds to the fork's): where one is not the true gradient,
FORK_GRADIENT_IS_WRONG names the case, its replays hold ours to the finite differences
instead, and docs/fork-layers.md says so."""
import pathlib
import shutil

import numpy as np
import pytest
from google.protobuf import text_format

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.layer import TEST, TRAIN
from caffe_syncbn.testing import numeric_gradient

FORK_GOLDEN = pathlib.Path(__file__).parent / 'fork_golden'
RTOL, ATOL = 1e-4, 1e-5
#: cases whose fork backward is not the gradient of its forward (test_the_forks_gradient_is_
#: the_true_one finds out): SegNet's BN drops the diffs of its batch mean and variance tops
FORK_GRADIENT_IS_WRONG = {'segnet/bn_learn_statistics'}
#: blobs that are indices, not values: no gradient flows into them, and none is checked
INDEX_BLOBS = {'label', 'mask'}


def kind_of(text):
    if 'input:' not in text:
        return 'data'           # a data layer feeds the net: its batches are recorded
    if 'type: "MatWrite"' in text:
        return 'files'          # its files are recorded
    return 'net'


def cases(kind):
    """'<fork>/<case>' of every golden: 'data' (data layers' batches), 'files' (MatWrite's
    files), 'net' (the others), or 'backward' (those that ran a backward)."""
    names = []
    for path in sorted(FORK_GOLDEN.glob('*/*.prototxt')):
        text = path.read_text()
        if kind == kind_of(text) or kind == 'backward' and ('force_backward: true' in text
                                                            or 'Loss"' in text):
            names.append('%s/%s' % (path.parent.name, path.stem))
    return names


def load(name):
    ref = np.load(FORK_GOLDEN / (name + '.npz'))
    return ref, TRAIN if str(ref['phase']) == 'TRAIN' else TEST


def earlier_forwards(ref):
    """The prefixes of the forwards recorded before the last (forward0/, ...)."""
    numbers = {int(k.split('/', 1)[0][len('forward'):]) for k in ref.files
               if k.startswith('forward')}
    return ['forward%d/' % k for k in sorted(numbers)]


def close(actual, expected, what):
    """RTOL relative plus ATOL relative to the array's largest value, as float32 sums round
    at the scale of their largest terms (tests/test_golden_nets.py)."""
    actual = caffe.backend.to_numpy(actual)
    assert actual.shape == expected.shape, '%s: shape %s, expected %s' % (
        what, actual.shape, expected.shape)
    scale = max(1.0, float(np.abs(expected).max())) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL * scale, err_msg=what)


def keys(ref, kind):
    return {k[len(kind) + 1:]: ref[k] for k in ref.files if k.startswith(kind + '/')}


def set_params(net, params):
    for key, values in params.items():
        layer, index = key.rsplit('/', 1)
        net.params[layer][int(index)].data[...] = net.context.xp.asarray(values)


def objective_weights(net, ref):
    """The top diffs the fork's backward started from: the recorded ones, 1 for the loss."""
    weights = keys(ref, 'topdiff')
    for name in net.outputs:
        weights.setdefault(name, np.ones_like(ref['data/' + name]))
    return weights


def fork_gradients(ref):
    """The fork's diffs of the inputs that take a gradient, and its param diffs."""
    return {('input', name): ref['diff/' + name] for name in keys(ref, 'input')
            if name not in INDEX_BLOBS} | {('param', key): value
                                           for key, value in keys(ref, 'param_diff').items()}


def finite_differences(name, ref, phase):
    """Central differences in float64 of sum(top diff * output) through our Net, for every
    array fork_gradients names."""
    net = caffe.Net(str(FORK_GOLDEN / (name + '.prototxt')), phase, dtype=np.float64)
    set_params(net, keys(ref, 'param'))
    inputs = {k: v.astype(np.float64) for k, v in keys(ref, 'input').items()}
    weights = objective_weights(net, ref)

    def objective():
        outputs = net.forward(**inputs)
        return sum(float(np.sum(weights[k] * outputs[k])) for k in net.outputs)

    numeric = {}
    for kind, key in fork_gradients(ref):
        if kind == 'input':
            target = inputs[key]
        else:
            layer, index = key.rsplit('/', 1)
            target = net.params[layer][int(index)].data
        numeric[kind, key] = numeric_gradient(target, objective).reshape(target.shape)
    return numeric


def has_backward(ref):
    return any(k.startswith('diff/') for k in ref.files)


@pytest.mark.parametrize('name', cases('net'))
def test_net_replays_the_fork(name, monkeypatch):
    """The whole net from the prototxt and the fork's own caffemodel (its layers' settings at
    the fork's field numbers): every blob of every forward, then every diff and param diff of
    the backward."""
    ref, phase = load(name)
    folder, case = (FORK_GOLDEN / name).parent, (FORK_GOLDEN / name).name
    monkeypatch.chdir(folder)
    weights = case + '.caffemodel'
    net = caffe.Net(case + '.prototxt', phase,
                    weights=weights if (folder / weights).exists() else None)
    for key, values in keys(ref, 'param').items():
        layer, index = key.rsplit('/', 1)
        close(net.params[layer][int(index)].data, values, 'param/' + key + ' from the caffemodel')
    for prefix in earlier_forwards(ref) + ['']:
        net.forward(**keys(ref, prefix + 'input'))
        for blob, values in keys(ref, prefix + 'data').items():
            close(net.blobs[blob].data, values, prefix + 'data/' + blob)
    if not has_backward(ref):
        return
    net.clear_param_diffs()
    for blob, values in keys(ref, 'topdiff').items():
        net.blobs[blob].diff[...] = net.context.xp.asarray(values)
    net.backward()
    if name in FORK_GRADIENT_IS_WRONG:
        expected = finite_differences(name, ref, phase)
    else:
        expected = fork_gradients(ref)
    for (kind, key), values in expected.items():
        if kind == 'input':
            got = net.blobs[key].diff
        else:
            layer, index = key.rsplit('/', 1)
            got = net.params[layer][int(index)].diff
        close(got, values.astype(np.float32), '%s diff %s' % (kind, key))


@pytest.mark.parametrize('name', cases('backward'))
def test_the_forks_gradient_is_the_true_one(name):
    """The fork's backward against central differences of its forward (our Net in float64,
    which the replay holds to the fork's forward), at float32's precision."""
    ref, phase = load(name)
    numeric = finite_differences(name, ref, phase)
    wrong = []
    for what, fork in fork_gradients(ref).items():
        scale = max(1.0, float(np.abs(numeric[what]).max()))
        if not np.allclose(fork, numeric[what], rtol=1e-3, atol=1e-4 * scale):
            wrong.append(what)
    assert bool(wrong) == (name in FORK_GRADIENT_IS_WRONG), wrong


@pytest.mark.parametrize('name', cases('net'))
def test_layer_replays_the_fork_on_every_engine(name, engine):
    """The case's last layer alone, fed the fork's bottoms of every forward and its top diffs,
    on each engine (against finite differences where the fork's gradient is not the true
    one)."""
    ref, phase = load(name)
    net_param = text_format.Parse((FORK_GOLDEN / (name + '.prototxt')).read_text(),
                                  caffe_pb2.NetParameter())
    param = net_param.layer[-1]
    forwards = earlier_forwards(ref) + ['']
    data = keys(ref, forwards[0] + 'data')
    layer, bottom, top = engine.build(param, [data[b] for b in param.bottom], phase=phase,
                                      dtype=np.float32)
    xp = engine.xp
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = xp.asarray(ref['param/%s/%d' % (param.name, i)])
    for prefix in forwards:
        data = keys(ref, prefix + 'data')
        for blob, bottom_name in zip(bottom, param.bottom):
            blob.data[...] = xp.asarray(data[bottom_name])
        engine.forward(layer, bottom, top)
        for blob, top_name in zip(top, param.top):
            close(engine.host(blob.data), data[top_name], prefix + 'data/' + top_name)
    if not has_backward(ref):
        return
    for blob, top_name in zip(top, param.top):
        diff = ref['topdiff/' + top_name] if 'topdiff/' + top_name in ref.files \
            else np.ones_like(data[top_name])
        blob.diff[...] = xp.asarray(diff)
    for blob in list(bottom) + list(layer.blobs):
        blob.diff[...] = 0
    wanted = [b not in INDEX_BLOBS for b in param.bottom]
    layer.backward(top, wanted, bottom)
    numeric = finite_differences(name, ref, phase) if name in FORK_GRADIENT_IS_WRONG else {}
    for blob, bottom_name, down in zip(bottom, param.bottom, wanted):
        if down:
            want = numeric.get(('input', bottom_name), ref['diff/' + bottom_name])
            close(engine.host(blob.diff), want.astype(np.float32), 'diff/' + bottom_name)
    for i, blob in enumerate(layer.blobs):
        key = '%s/%d' % (param.name, i)
        want = numeric.get(('param', key), ref['param_diff/' + key])
        close(engine.host(blob.diff), want.astype(np.float32), 'param_diff/' + key)


@pytest.mark.parametrize('name', cases('data'))
def test_data_layer_reads_as_the_fork(name, monkeypatch):
    """Two batches of two from three image and label pairs, the second wrapping round to the
    first pair, as the fork's data layer read them: every top."""
    ref, phase = load(name)
    monkeypatch.chdir((FORK_GOLDEN / name).parent)
    net = caffe.Net((FORK_GOLDEN / name).name + '.prototxt', phase)
    for batch in range(2):
        net.forward()
        for blob, values in keys(ref, 'batch%d' % batch).items():
            np.testing.assert_array_equal(caffe.backend.to_numpy(net.blobs[blob].data), values,
                                          err_msg='batch %d %s' % (batch, blob))


@pytest.mark.parametrize('name', cases('files'))
def test_mat_write_writes_what_the_fork_wrote(name, tmp_path, monkeypatch):
    """The net's forwards in a copy of the case's folder: each file read back (scipy) holds
    the array, type and name of the fork's file of the same name."""
    scipy_io = pytest.importorskip('scipy.io')
    ref, phase = load(name)
    folder = (FORK_GOLDEN / name).parent
    shutil.copy(FORK_GOLDEN / (name + '.prototxt'), tmp_path)
    (tmp_path / 'mat').mkdir()
    shutil.copy(folder / 'mat' / 'names.txt', tmp_path / 'mat')
    monkeypatch.chdir(tmp_path)
    net = caffe.Net((FORK_GOLDEN / name).name + '.prototxt', phase)
    for prefix in earlier_forwards(ref) + ['']:
        net.forward(**keys(ref, prefix + 'input'))
    written = sorted(p.name for p in (tmp_path / 'mat').glob('*.mat'))
    assert written == sorted(p.name for p in (folder / 'mat').glob('*.mat'))
    for file_name in written:
        ours = scipy_io.loadmat(tmp_path / 'mat' / file_name)
        forks = scipy_io.loadmat(folder / 'mat' / file_name)
        assert sorted(k for k in ours if not k.startswith('__')) == \
            sorted(k for k in forks if not k.startswith('__')) == ['data'], file_name
        assert ours['data'].dtype == forks['data'].dtype, file_name
        np.testing.assert_array_equal(ours['data'], forks['data'], err_msg=file_name)
