"""Every layer, net and format golden case, replayed through a whole Net as BVLC Caffe ran it."""
import json

import numpy as np
import pytest

import caffe_syncbn as caffe
from helpers.paths import GOLDEN, require

RTOL, ATOL = 1e-4, 1e-5
# Data-layer cases compare batches, not blobs: tests/layers/test_data.py and the pipeline tests run them.
SKIP_PREFIXES = ('data_lmdb_', 'datum_lmdb', 'data_hdf5')


def cases():
    out = []
    for index in ('index.json', 'psp_index.json'):
        path = GOLDEN / index
        if not path.exists():
            continue
        for case in json.loads(path.read_text())['cases']:
            if case['kind'] in ('layer', 'net', 'format') and not case['name'].startswith(SKIP_PREFIXES) \
                    and (GOLDEN / (case['name'] + '.npz')).exists():
                out.append(case['name'])
    return out or ['<no golden data>']


def weights_for(name):
    for candidate in (name + '.caffemodel.h5', name + '.v1.caffemodel', name + '.caffemodel'):
        if name.startswith('format_hdf5') and not candidate.endswith('.h5'):
            continue
        if (GOLDEN / candidate).exists():
            return candidate
    return None


def assert_close(actual, expected, what):
    """1e-4 relative plus 1e-5 absolute, the absolute part taken relative to the blob's
    largest value: float32 sums round at the scale of their largest terms, and a layer
    that divides by a tiny spread (BatchNorm of a near-constant channel) magnifies the
    rounding of its input, ours and Caffe's alike, at that scale."""
    actual = caffe.backend.to_numpy(actual)
    assert actual.shape == expected.shape, '%s: shape %s, expected %s' % (what, actual.shape, expected.shape)
    scale = max(1.0, float(np.abs(expected).max())) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL * scale, err_msg=what)


def replay(net, ref):
    """Run ``net`` as the golden generator ran Caffe, comparing every recorded array."""
    inputs = {k.split('/', 1)[1]: ref[k] for k in ref.files if k.startswith('input/')}
    n_forward = int(ref['n_forward']) if 'n_forward' in ref.files else 1
    for _ in range(n_forward):
        net.forward(**inputs)
    for key in ref.files:
        kind, _, rest = key.partition('/')
        if kind == 'data':
            assert_close(net.blobs[rest].data, ref[key], key)
        elif kind == 'param_after':
            layer, index = rest.rsplit('/', 1)
            assert_close(net.params[layer][int(index)].data, ref[key], key)
    if not any(k.startswith('diff/') for k in ref.files):
        return
    net.clear_param_diffs()
    for key in ref.files:
        if key.startswith('topdiff/'):
            net.blobs[key.split('/', 1)[1]].diff[...] = net.context.xp.asarray(ref[key])
    net.backward()
    for key in ref.files:
        kind, _, rest = key.partition('/')
        if kind == 'diff':
            assert_close(net.blobs[rest].diff, ref[key], key)
        elif kind == 'param_diff':
            layer, index = rest.rsplit('/', 1)
            assert_close(net.params[layer][int(index)].diff, ref[key], key)


def run_case(name, monkeypatch):
    """Build the golden case ``name`` in the current mode (CPU or GPU) and replay it."""
    require(GOLDEN / (name + '.npz'))
    monkeypatch.chdir(GOLDEN)          # prototxt paths (HDF5 sources, infogain files) are relative
    ref = np.load(GOLDEN / (name + '.npz'))
    phase = caffe.TRAIN if str(ref['phase']) == 'TRAIN' else caffe.TEST
    net = caffe.Net(name + '.prototxt', phase, weights=weights_for(name))
    replay(net, ref)


@pytest.mark.parametrize('name', cases())
def test_golden_case(name, monkeypatch):
    run_case(name, monkeypatch)


def test_v1_prototxt_builds_the_same_net(monkeypatch):
    require(GOLDEN / 'format_v1_caffemodel.v1.prototxt')
    monkeypatch.chdir(GOLDEN)
    ref = np.load('format_v1_caffemodel.npz')
    net = caffe.Net('format_v1_caffemodel.v1.prototxt', caffe.TEST,
                    weights='format_v1_caffemodel.v1.caffemodel')
    replay(net, ref)
