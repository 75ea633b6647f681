"""BatchNorm, BN and SyncBN (alone): golden cases and every engine against the float64 array
engine (the engine fixture), gradient checks, running-stat rules. SyncBN over replicas:
test_norm_syncbn.py; the CUDA engine's passes and kernels on the emulation: test_norm_cuda.py."""
import json

import numpy as np
import pytest
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2
from caffe_syncbn.backend import cpu_threads
from caffe_syncbn.blob import Blob
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.fillers import set_random_seed
from caffe_syncbn.layer import TEST, TRAIN, LayerContext, create_layer
from caffe_syncbn.layers.norm import gpu as norm_gpu, host as norm_host
from caffe_syncbn.testing import build_layer, layer_param
from helpers.engines import TOLERANCE, Engine
from helpers.paths import GOLDEN, require

RTOL, ATOL = 1e-4, 1e-5
NORM_TYPES = {'BatchNorm', 'BN'}


def golden_cases():
    """Single-layer golden cases (Input + one norm layer) of both golden sets."""
    names = []
    for index in ('index.json', 'psp_index.json'):
        if (GOLDEN / index).exists():
            names += [c['name'] for c in json.loads((GOLDEN / index).read_text())['cases']
                      if c['kind'] == 'layer' and set(c['layer_types']) - {'Input'} <= NORM_TYPES
                      and len(c['layer_types']) == 2]
    return names or ['<no golden data>']


def close(actual, expected, what):
    assert actual.shape == expected.shape, '%s: shape %s, expected %s' % (
        what, actual.shape, expected.shape)
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL, err_msg=what)


def replay_golden(name, engine, dtype=np.float32):
    """Build the case's one layer with its caffemodel blobs on ``engine``, run forward
    n_forward times, then backward, comparing everything Caffe recorded."""
    require(GOLDEN / (name + '.npz'))
    net = text_format.Parse((GOLDEN / (name + '.prototxt')).read_text(), caffe_pb2.NetParameter())
    (param,) = [lp for lp in net.layer if lp.type != 'Input']
    weights = caffe_pb2.NetParameter()
    weights.ParseFromString((GOLDEN / (name + '.caffemodel')).read_bytes())
    (saved,) = [lp for lp in weights.layer if lp.name == param.name]
    ref = np.load(GOLDEN / (name + '.npz'))
    phase = TRAIN if str(ref['phase']) == 'TRAIN' else TEST
    x = ref['input/' + param.bottom[0]]
    layer, bottom, top = engine.build(param, [x], phase=phase, dtype=dtype)
    xp, host = engine.xp, engine.host
    for blob, proto in zip(layer.blobs, saved.blobs):
        blob.data[...] = xp.asarray(np.asarray(proto.data, dtype).reshape(blob.shape))
    for _ in range(int(ref['n_forward']) if 'n_forward' in ref.files else 1):
        bottom[0].data[...] = xp.asarray(x.astype(dtype))
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
    close(host(top[0].data), ref['data/' + param.top[0]], 'data')
    for i, blob in enumerate(layer.blobs):
        close(host(blob.data), ref['param_after/%s/%d' % (param.name, i)], 'param_after/%d' % i)
    top[0].diff[...] = xp.asarray(ref['topdiff/' + param.top[0]].astype(dtype))
    for blob in layer.blobs:
        blob.diff[...] = 0
    layer.backward(top, [True], bottom)
    close(host(bottom[0].diff), ref['diff/' + param.bottom[0]], 'diff')
    for i, blob in enumerate(layer.blobs):
        close(host(blob.diff), ref['param_diff/%s/%d' % (param.name, i)], 'param_diff/%d' % i)


@pytest.mark.parametrize('dtype', [np.float32, np.float64])
@pytest.mark.parametrize('name', golden_cases())
def test_golden(name, dtype, engine):
    replay_golden(name, engine, dtype)


# ----------------------------------------------------------------------------- every engine

NORMS = [
    'type: "BatchNorm"',
    'type: "BatchNorm" batch_norm_param { use_global_stats: true }',
    'type: "BN" bn_param { momentum: 0.9 }',
    'type: "BN" bn_param { frozen: true }',
    'type: "SyncBN" bn_param { momentum: 0.9 }',
    'type: "SyncBN" bn_param { frozen: true }',
]


def run_engine(engine, body, shape, phase, in_place, learned=(True, True), dtype=np.float64,
               steps=2, dy_shift=0):
    """Two forward passes (the running statistics move), then backward: the top, the
    bottom's diff, the params' diffs and values, on the host. The top's diff is standard
    normal, plus ``dy_shift`` and rounded to float16 (exact in every dtype) when given."""
    text = 'name: "bn" %s bottom: "x" top: "%s"' % (body, 'x' if in_place else 'y')
    rs = np.random.RandomState(2)
    x = rs.standard_normal(shape) * 3 + 5
    layer, bottom, top = engine.build(text, [x], phase=phase, dtype=dtype)
    assert (layer.engine is norm_gpu) == engine.on_device
    top = bottom if in_place else top
    for i, blob in enumerate(layer.blobs):
        blob.data[...] = engine.xp.asarray((np.abs(rs.standard_normal(blob.shape)) + 0.5)
                                           .astype(dtype))
    if len(layer.blobs) == 4:
        layer.param_propagate_down = list(learned) + [False, False]
    for _ in range(steps):
        bottom[0].data[...] = engine.xp.asarray(x.astype(dtype))
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
    y = engine.host(top[0].data).astype(np.float64)
    dy = rs.standard_normal(shape)
    if dy_shift:
        dy = (dy + dy_shift).astype(np.float16)
    top[0].diff[...] = engine.xp.asarray(dy.astype(dtype))
    layer.backward(top, [True], bottom)
    return [y, engine.host(bottom[0].diff)] + [engine.host(b.diff) for b in layer.blobs] + \
        [engine.host(b.data) for b in layer.blobs]


@pytest.mark.parametrize('learned', [(True, True), (False, True)], ids=['slope and bias', 'bias'])
@pytest.mark.parametrize('in_place', [False, True])
@pytest.mark.parametrize('phase', [TRAIN, TEST], ids=['TRAIN', 'TEST'])
@pytest.mark.parametrize('body', NORMS)
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_every_engine_gives_the_float64_array_engine(engine, body, phase, in_place, learned,
                                                     dtype, monkeypatch):
    monkeypatch.setattr(cpu_threads, 'BLOCK_BYTES', 64)       # the host in many blocks
    monkeypatch.setattr(cpu_threads, 'PARALLEL_MIN_ELEMENTS', 1)
    with pytest.MonkeyPatch.context() as patch:
        reference = Engine('array', patch)
        for shape in [(3, 4, 5, 2), (2, 3), (4, 2, 1, 1), (3, 2, 16)]:
            want = run_engine(reference, body, shape, phase, in_place, learned)
            got = run_engine(engine, body, shape, phase, in_place, learned, dtype)
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype],
                                           err_msg='%s %s' % (engine, shape))


@pytest.mark.parametrize('shape', [(2, 3, 3, 3), (4, 2), (3, 2, 16)])
def test_float16_on_every_engine(engine, shape):
    """float16 blobs, computed in float32 (the kernels, the host's blocks) and float64 (the
    sums)."""
    with pytest.MonkeyPatch.context() as patch:
        want = run_engine(Engine('array', patch), NORMS[4], shape, TRAIN, False)
    got = run_engine(engine, NORMS[4], shape, TRAIN, False, dtype=np.float16)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=TOLERANCE[np.float16], atol=TOLERANCE[np.float16])


def test_float16_sums_past_the_float16_range_give_a_finite_gradient(engine):
    """A diff of mean 300 over 2048 values per channel sums to 6e5, past float16's largest
    value (65504), while the input gradient (dy less its mean, ~1) is small: the engines
    sum half blobs in float32 or wider, and no finite gradient becomes inf. Mixed
    precision's loss scale makes diffs this large."""
    shape = (8, 2, 16, 16)
    with pytest.MonkeyPatch.context() as patch:
        want = run_engine(Engine('array', patch), NORMS[0], shape, TRAIN, False, dy_shift=300)
    got = run_engine(engine, NORMS[0], shape, TRAIN, False, dtype=np.float16, dy_shift=300)
    assert np.isfinite(got[1]).all()
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=TOLERANCE[np.float16], atol=TOLERANCE[np.float16])


@pytest.mark.parametrize('body', NORMS)
def test_host_engine_on_threads(body, threads, monkeypatch):
    monkeypatch.setattr(cpu_threads, 'BLOCK_BYTES', 64)
    monkeypatch.setattr(cpu_threads, 'PARALLEL_MIN_ELEMENTS', 1)
    results = []
    for name in ('array', 'host'):
        results.append(run_engine(Engine(name, monkeypatch), body, (3, 4, 5, 2), TRAIN, True))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def test_host_engine_keeps_x_hat_only_in_place_when_its_backward_reads_it():
    text = 'name: "bn" type: "BatchNorm" bottom: "x" top: "%s" %s'
    x = inputs((2, 3, 4, 4))
    for top, param, kept in [('x', '', True), ('y', '', False),
                             ('x', 'batch_norm_param { use_global_stats: true }', False)]:
        layer, bottom, tops = build_layer(text % (top, param), [x])
        assert layer.engine is norm_host
        tops = bottom if top == 'x' else tops
        layer.forward(bottom, tops)
        held = layer._x_hat is not None and layer._x_hat.kept is not None
        assert held == kept, (top, param)


# ----------------------------------------------------------------------------- gradient checks

def bn_text(kind='BN', extra=''):
    body = ('bn_param { slope_filler { type: "gaussian" mean: 1 std: 0.3 } '
            'bias_filler { type: "gaussian" std: 0.5 } momentum: 0.9 %s }' % extra)
    return 'name: "bn" type: "%s" bottom: "x" top: "y" %s' % (kind, body)


def inputs(shape, seed=3):
    rs = np.random.RandomState(seed)
    offsets = rs.uniform(-2, 2, (1, shape[1]) + (1,) * (len(shape) - 2))
    return rs.standard_normal(shape) * 1.5 + offsets


@pytest.mark.parametrize('shape', [(3, 2, 3, 2), (5, 3), (2, 2, 2, 2, 2)])
def test_gradient_batchnorm_batch_stats(host_engine, shape):
    host_engine.check_gradient('name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
                               'batch_norm_param { eps: 0.01 }', [inputs(shape)])


@pytest.mark.parametrize('phase', [TRAIN, TEST])
def test_gradient_batchnorm_global_stats(host_engine, phase):
    # zero state: mean = var = 0, so y = x / sqrt(eps); the stats are not parameters
    host_engine.check_gradient('name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
                               'batch_norm_param { use_global_stats: true eps: 0.5 }',
                               [inputs((2, 3, 2, 2))], phase=phase)


@pytest.mark.parametrize('kind', ['BN', 'SyncBN'])
@pytest.mark.parametrize('shape', [(3, 2, 3, 2), (6, 3), (1, 2, 3, 3)])
def test_gradient_train(host_engine, kind, shape):
    host_engine.check_gradient(bn_text(kind, 'eps: 0.01'), [inputs(shape)])


@pytest.mark.parametrize('kind', ['BN', 'SyncBN'])
@pytest.mark.parametrize('phase', [TRAIN, TEST])
def test_gradient_frozen(host_engine, kind, phase):
    host_engine.check_gradient(bn_text(kind, 'frozen: true'), [inputs((2, 3, 2, 2))], phase=phase)


def test_gradient_bn_test_params_only(host_engine):
    # the forks' TEST backward for x is the batch formula (not the gradient): params only
    host_engine.check_gradient(bn_text('BN'), [inputs((2, 3, 2, 2))], check_bottom=[], phase=TEST)


def test_gradient_syncbn_test_is_true_gradient(host_engine):
    host_engine.check_gradient(bn_text('SyncBN'), [inputs((2, 3, 2, 2))], phase=TEST)


# ----------------------------------------------------------------------------- semantics

def run(kind, x, phase=TRAIN, extra='', dtype=np.float64, steps=1):
    set_random_seed(0)                           # every call draws the same slope and bias
    layer, bottom, top = build_layer(bn_text(kind, extra), [x], phase=phase, dtype=dtype)
    for _ in range(steps):
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
    return layer, bottom, top


def test_syncbn_alone_equals_bn_but_unbiased_running_var():
    x = inputs((4, 3, 2, 5))
    bn, _, bn_top = run('BN', x, steps=2)
    sync, _, sync_top = run('SyncBN', x, steps=2)
    m = 4 * 2 * 5
    np.testing.assert_allclose(sync_top[0].data, bn_top[0].data, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sync.blobs[2].data, bn.blobs[2].data, rtol=1e-12)
    np.testing.assert_allclose(sync.blobs[3].data, bn.blobs[3].data * m / (m - 1), rtol=1e-12)


def test_bn_running_stat_convention():
    x = inputs((3, 2, 4, 4))
    layer, _, _ = run('BN', x, extra='frozen: false')
    batch_mean, batch_var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    new = 1 - float(np.float32(0.9))             # momentum is a proto float
    np.testing.assert_allclose(layer.blobs[2].data.ravel(), new * batch_mean, rtol=1e-12)
    np.testing.assert_allclose(layer.blobs[3].data.ravel(), new * batch_var, rtol=1e-12)


def test_frozen_init_and_no_update():
    layer, bottom, top = run('BN', inputs((2, 3, 2, 2)), extra='frozen: true', steps=2)
    assert np.all(layer.blobs[3].data == 1) and np.all(layer.blobs[2].data == 0)
    assert [layer.fixed_param_mults(j) for j in range(4)] == [(0.0, 0.0)] * 4
    assert layer.param_propagate_down == [False] * 4
    top[0].diff[...] = 1
    layer.param_propagate_down = [True] * 4      # as under force_backward: still no gradient
    layer.backward(top, [True], bottom)
    assert all(np.all(b.diff == 0) for b in layer.blobs)


def test_fixed_param_mults():
    bn, _, _ = run('BN', inputs((2, 3)))
    assert [bn.fixed_param_mults(j) for j in range(4)] == [None, None, (0.0, 0.0), (0.0, 0.0)]
    batchnorm, _, _ = build_layer('name: "b" type: "BatchNorm" bottom: "x" top: "y"',
                                  [inputs((2, 3))])
    assert [batchnorm.fixed_param_mults(j) for j in range(3)] == [(0.0, None)] * 3


def test_batchnorm_rejects_learned_statistics():
    with pytest.raises(CaffeError, match="layer 'b'.*lr_mult"):
        build_layer('name: "b" type: "BatchNorm" bottom: "x" top: "y" param { lr_mult: 1 }',
                    [inputs((2, 3))])


def test_inplace_matches_out_of_place():
    x, dy = inputs((3, 2, 2, 2)), inputs((3, 2, 2, 2), seed=9)
    for kind in ('BN', 'SyncBN'):
        ref_layer, ref_bottom, ref_top = run(kind, x)
        ref_top[0].diff[...] = dy
        ref_layer.backward(ref_top, [True], ref_bottom)
        set_random_seed(0)                       # the same slope and bias as ref_layer
        layer = create_layer(layer_param(bn_text(kind)), LayerContext(TRAIN, dtype=np.float64))
        blob = Blob(x.shape, np.float64)
        blob.data[...] = x
        layer.setup([blob], [blob])
        layer.reshape([blob], [blob])
        layer.forward([blob], [blob])
        np.testing.assert_allclose(blob.data, ref_top[0].data, rtol=1e-12, atol=1e-12)
        blob.diff[...] = dy
        layer.backward([blob], [True], [blob])
        np.testing.assert_allclose(blob.diff, ref_bottom[0].diff, rtol=1e-10, atol=1e-12)


def test_empty_batch_alone_is_a_clear_error():
    with pytest.raises(CaffeError, match="layer 'bn'.*empty"):
        run('BN', np.zeros((0, 3, 2, 2)))


def test_channel_mismatch_is_a_clear_error():
    layer, bottom, top = run('BN', inputs((2, 3, 2, 2)))
    bottom[0].reshape(2, 4, 2, 2)
    with pytest.raises(CaffeError, match=r"expected 3 channels.*\(2, 4, 2, 2\)"):
        layer.reshape(bottom, top)


@pytest.mark.parametrize('kind', ['BN', 'SyncBN'])
def test_float16_blobs_compute_in_float32(kind):
    x = inputs((4, 3, 3, 3))
    ref, _, ref_top = run(kind, x)
    layer, _, top = run(kind, x.astype(np.float16), dtype=np.float16)
    assert top[0].data.dtype == np.float16
    np.testing.assert_allclose(top[0].data, ref_top[0].data, rtol=2e-2, atol=2e-2)
