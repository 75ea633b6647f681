"""SegNet's and ENet's BN (the BN that names scale_filler, shift_filler or bn_mode): an
independent float64 reference written from the forks' bn_layer.cpp (variance as E(x^2) -
E(x)^2, eps 1e-9, no running statistics), every engine, finite differences, the batch
mean and variance tops, telling it from PSPNet's BN, and its SyncBN on N replicas against
one layer on the whole batch."""
import numpy as np
import pytest

from caffe_syncbn import caffe_pb2
from caffe_syncbn.blob import Blob
from caffe_syncbn.comm import ThreadComm
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.layer import TEST, TRAIN, LayerContext, create_layer
from caffe_syncbn.layers.norm.batch_norm import BN
from caffe_syncbn.layers.norm.segnet_bn import SegNetBN, SyncSegNetBN
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.testing import build_layer, check_gradient, layer_param
from helpers.engines import TOLERANCE, Engine
from helpers.threads import run_threads

FILLERS = ('scale_filler { type: "uniform" min: 0.5 max: 1.5 } '
           'shift_filler { type: "gaussian" std: 0.5 }')


def segnet_text(mode='LEARN', tops=('y',), kind='BN', bottom='x'):
    return ('name: "bn" type: "%s" bottom: "%s" %s bn_param { %s bn_mode: %s }'
            % (kind, bottom, ' '.join('top: "%s"' % t for t in tops), FILLERS, mode))


def fork_forward(x, scale, shift, mode):
    """bn_layer.cpp's Forward_cpu in float64: E(x) and E(x^2) per channel over N, H, W."""
    per_channel = (1, -1, 1, 1)
    scale, shift = scale.reshape(per_channel), shift.reshape(per_channel)
    if mode == 'INFERENCE':
        return scale * x + shift, None, None
    mean = (x.mean(axis=(2, 3))).mean(axis=0)
    var = ((x ** 2).mean(axis=(2, 3))).mean(axis=0) - mean ** 2
    x_norm = (x - mean.reshape(per_channel)) / np.sqrt(var + 1e-9).reshape(per_channel)
    return scale * x_norm + shift, mean, var


def fork_backward(x, dy, scale, mode):
    """bn_layer.cpp's Backward_cpu in float64: (dx, dscale, dshift)."""
    per_channel = (1, -1, 1, 1)
    axes = (0, 2, 3)
    if mode == 'INFERENCE':
        return scale.reshape(per_channel) * dy, (x * dy).sum(axis=axes), dy.sum(axis=axes)
    _, mean, var = fork_forward(x, np.ones_like(scale), np.zeros_like(scale), mode)
    std = np.sqrt(var + 1e-9).reshape(per_channel)
    x_norm = (x - mean.reshape(per_channel)) / std
    buffer = scale.reshape(per_channel) * dy
    m = x.size // x.shape[1]
    dx = buffer - ((x_norm * buffer).sum(axis=axes).reshape(per_channel) * x_norm
                   + buffer.sum(axis=axes).reshape(per_channel)) / m
    return dx / std, (x_norm * dy).sum(axis=axes), dy.sum(axis=axes)


def sample(seed=0, shape=(4, 3, 5, 6)):
    rs = np.random.RandomState(seed)
    x = rs.standard_normal(shape) * rs.uniform(0.5, 3, (1, shape[1], 1, 1)) + 4
    scale, shift = rs.uniform(0.5, 1.5, shape[1]), rs.standard_normal(shape[1])
    return x, rs.standard_normal(shape), scale, shift


def run(engine, text, x, dy, scale, shift, phase=TRAIN, dtype=np.float64, in_place=False,
        statistics_diff=()):
    param = layer_param(text)
    if in_place:
        param.top[0] = param.bottom[0]
    layer, bottom, top = engine.build(param, [x], phase=phase, dtype=dtype)
    top = bottom[:1] + top[1:] if in_place else top
    xp = engine.xp
    for blob, value in zip(layer.blobs, (scale, shift)):
        blob.data[...] = xp.asarray(value.reshape(blob.shape).astype(dtype))
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    outputs = [engine.host(t.data).astype(np.float64).copy() for t in top]
    top[0].diff[...] = xp.asarray(dy.astype(dtype))
    for blob, diff in zip(top[1:], statistics_diff):
        blob.diff[...] = xp.asarray(diff.reshape(blob.shape).astype(dtype))
    layer.backward(top, [True], bottom)
    return outputs, engine.host(bottom[0].diff).astype(np.float64), \
        [engine.host(b.diff).reshape(-1).astype(np.float64) for b in layer.blobs]


@pytest.mark.parametrize('in_place', [False, True])
@pytest.mark.parametrize('phase', [TRAIN, TEST], ids=['TRAIN', 'TEST'])
@pytest.mark.parametrize('mode', ['LEARN', 'INFERENCE'])
@pytest.mark.parametrize('dtype', [np.float32, np.float64])
def test_every_engine_gives_the_fork(engine, mode, phase, in_place, dtype):
    """LEARN normalizes with the batch's statistics in TEST too: the forks keep none."""
    x, dy, scale, shift = sample()
    tops = ('y',) if in_place or mode == 'INFERENCE' else ('y', 'mean', 'var')
    outputs, dx, (dscale, dshift) = run(engine, segnet_text(mode, tops), x, dy, scale, shift,
                                        phase, dtype, in_place)
    y, mean, var = fork_forward(x, scale, shift, mode)
    want_dx, want_dscale, want_dshift = fork_backward(x, dy, scale, mode)
    tolerance = TOLERANCE[dtype] * 10
    for got, want, what in [(outputs[0], y, 'y'), (dx, want_dx, 'dx'),
                            (dscale, want_dscale, 'dscale'), (dshift, want_dshift, 'dshift')] \
            + list(zip(outputs[1:], (mean.reshape(1, -1, 1, 1), var.reshape(1, -1, 1, 1))
                       if mean is not None else (), ('mean', 'var'))):
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance, err_msg=what)


@pytest.mark.parametrize('phase', [TRAIN, TEST], ids=['TRAIN', 'TEST'])
@pytest.mark.parametrize('mode, tops', [('LEARN', ('y',)), ('LEARN', ('y', 'mean', 'var')),
                                        ('LEARN', ('y', 'mean')), ('INFERENCE', ('y',))])
def test_the_gradient_is_the_true_one(host_engine, mode, tops, phase):
    """The forks' backward is the exact gradient of their forward where the statistics tops
    get no diff (the test above holds ours to it); finite differences say so, and that ours
    passes the statistics tops' diffs back too, which the forks' drop."""
    x, _, _, _ = sample(1, (3, 2, 4, 3))
    text = segnet_text(mode, tops)
    with pytest.MonkeyPatch.context():
        assert check_gradient(text, [x], phase=phase, tolerance=1e-6) < 1e-6


def test_param_diffs_add_up_over_backwards():
    """The forks overwrite the param diffs in each backward; every Caffe layer adds to them,
    as iter_size and shared params need, and so does this one."""
    x, dy, scale, shift = sample(2)
    layer, bottom, top = build_layer(segnet_text(), [x])
    layer.forward(bottom, top)
    top[0].diff[...] = dy
    for _ in range(2):
        layer.backward(top, [True], bottom)
    _, want_dscale, want_dshift = fork_backward(x, dy, layer.blobs[0].data.reshape(-1), 'LEARN')
    np.testing.assert_allclose(layer.blobs[0].diff.reshape(-1), 2 * want_dscale, rtol=1e-10)
    np.testing.assert_allclose(layer.blobs[1].diff.reshape(-1), 2 * want_dshift, rtol=1e-10)


# ---- which BN -------------------------------------------------------------------------------
@pytest.mark.parametrize('text, kind', [
    ('type: "BN" bn_param { scale_filler { value: 1 } }', SegNetBN),
    ('type: "BN" bn_param { bn_mode: INFERENCE }', SegNetBN),
    ('type: "BN" top: "m" top: "v"', SegNetBN),            # the statistics tops are SegNet's
    ('type: "BN" bn_param { slope_filler { value: 1 } }', BN),
    ('type: "BN" bn_param { frozen: true }', BN),
    ('type: "BN"', BN),
    ('type: "SyncBN" bn_param { shift_filler { value: 0 } }', SyncSegNetBN),
])
def test_the_settings_tell_the_two_forks_apart(text, kind):
    param = layer_param('name: "bn" bottom: "x" top: "y" ' + text)
    layer = create_layer(param, LayerContext())
    assert type(layer) is kind


def test_a_bn_with_both_forks_settings_is_one_line():
    with pytest.raises(CaffeError) as info:
        build_layer('name: "bn" type: "BN" bottom: "x" top: "y" bn_param { scale_filler '
                    '{ value: 1 } momentum: 0.9 }', [np.zeros((2, 3))])
    assert str(info.value) == (
        "layer 'bn' (type BN): bn_param mixes settings of SegNet's and ENet's BN "
        "(scale_filler) with settings of PSPNet's BN (momentum); the two forks' layers "
        'differ: keep the settings of one')


def test_enet_bn_parses_where_it_read_as_a_typo():
    """The issue's case: ENet's BN got 'BNParameter has no field scale_filler'."""
    text = '''layer { name: "bn0_1" type: "BN" bottom: "x" top: "y"
      param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 1 decay_mult: 0 }
      bn_param { scale_filler { type: "constant" value: 1.0 }
                 shift_filler { type: "constant" value: 0.001 } bn_mode: INFERENCE } }'''
    net = parse_text(text, caffe_pb2.NetParameter(), 'enet.prototxt')
    layer, bottom, top = build_layer(net.layer[0], [np.ones((1, 2, 3, 3))])
    layer.forward(bottom, top)
    np.testing.assert_allclose(top[0].data, 1.001)


def test_inference_refuses_the_statistics_tops():
    with pytest.raises(CaffeError, match="bn_mode INFERENCE has one top, got 3: the batch "
                                         "mean and variance tops are bn_mode LEARN's"):
        build_layer(segnet_text('INFERENCE', ('y', 'm', 'v')), [np.zeros((2, 3, 2, 2))])


# ---- SyncBN over replicas -------------------------------------------------------------------
def replica(comm, text, scale, shift, x):
    param = layer_param(text)
    layer = create_layer(param, LayerContext(phase=TRAIN, dtype=np.float64, comm=comm))
    bottom, top = [Blob(x.shape, np.float64)], [Blob((), np.float64) for _ in param.top]
    bottom[0].data[...] = x
    layer.setup(bottom, top)
    for blob, value in zip(layer.blobs, (scale, shift)):
        blob.data[...] = value.reshape(blob.shape)
    return layer, bottom, top


@pytest.mark.parametrize('sizes', [(3, 5), (2, 0, 4, 3)], ids=['2 replicas', '4, one empty'])
def test_sync_replicas_equal_one_layer_on_the_global_batch(sizes):
    """Forward, the mean and variance tops, dx and the sum of the replicas' param diffs: those
    of SegNet's BN on the whole batch (each replica's top diff is R times its share, as the
    global loss normalizer makes it; each gives the statistics tops the whole batch's diffs,
    which add up over the R replicas as R times the whole batch's)."""
    x, dy, scale, shift = sample(3, (sum(sizes), 3, 4, 5))
    statistics_diff = np.random.RandomState(4).standard_normal((2, 3))
    text = segnet_text('LEARN', ('y', 'mean', 'var'), kind='SyncBN')
    (y, mean, var), dx, (dscale, dshift) = run(Engine('array', None), segnet_text(
        'LEARN', ('y', 'mean', 'var')), x, dy, scale, shift, statistics_diff=statistics_diff)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    comms = ThreadComm.create(len(sizes))
    replicas = len(sizes)
    results = [None] * replicas

    def step(r):
        part = slice(bounds[r], bounds[r + 1])
        layer, bottom, top = replica(comms[r], text, scale, shift, x[part])
        layer.reshape(bottom, top)
        layer.forward(bottom, top)
        top[0].diff[...] = replicas * dy[part]
        for blob, diff in zip(top[1:], statistics_diff):
            blob.diff[...] = diff.reshape(blob.shape)
        layer.backward(top, [True], bottom)
        results[r] = ([t.data.copy() for t in top], bottom[0].diff.copy(),
                      [b.diff.reshape(-1).copy() for b in layer.blobs])

    for error in run_threads(step, replicas)[1]:
        if error is not None:
            raise error
    for r in range(replicas):
        (y_r, mean_r, var_r), dx_r, _ = results[r]
        part = slice(bounds[r], bounds[r + 1])
        np.testing.assert_allclose(y_r, y[part], rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(dx_r, replicas * dx[part], rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(mean_r, mean, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(var_r, var, rtol=1e-9, atol=1e-12)
    summed = [sum(results[r][2][j] for r in range(replicas)) / replicas for j in range(2)]
    np.testing.assert_allclose(summed[0], dscale, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(summed[1], dshift, rtol=1e-9, atol=1e-9)


def test_inference_mode_communicates_nothing():
    class Silent:
        size, rank = 2, 0

        def allreduce(self, *args, **kwargs):
            raise AssertionError('INFERENCE has nothing to synchronize')

    x, dy, scale, shift = sample(4)
    layer, bottom, top = replica(Silent(), segnet_text('INFERENCE', kind='SyncBN'), scale,
                                 shift, x)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    np.testing.assert_allclose(top[0].data, fork_forward(x, scale, shift, 'INFERENCE')[0])
