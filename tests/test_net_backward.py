"""The Net's backward: parameter sharing, lr/decay multipliers, loss weights, propagate_down,
force_backward and Caffe's rule for which layers run backward, with numpy references and
finite differences through whole nets."""
import numpy as np
import pytest

from caffe_syncbn.errors import CaffeError
from caffe_syncbn.testing import numeric_gradient
from helpers.net_helpers import (MLP, backward_calls, build, close, input_layer, ip_layer,
                                 load_pylayers, python_layer, randomize)


@pytest.fixture
def pylayers(monkeypatch):
    return load_pylayers(monkeypatch)


# ---- parameter sharing ---------------------------------------------------------------------
def shared_net(a_out=2, b_out=2, b_in=3, spec_a='param { name: "w" } param { name: "b" }',
               spec_b='param { name: "w" } param { name: "b" }', bias=True):
    return ('force_backward: true\n' + input_layer('x', 2, 3) + input_layer('x2', 4, b_in)
            + ip_layer('ip_a', 'x', 'a', a_out, spec_a, bias)
            + ip_layer('ip_b', 'x2', 'b', b_out, spec_b, bias))


def test_shared_params_are_one_blob_whose_diffs_accumulate():
    net = build(shared_net(), dtype=np.float64)
    assert net.params['ip_b'][0] is net.params['ip_a'][0] and len(net.learnable_params) == 2
    randomize(net)
    rs = np.random.RandomState(8)
    x, x2 = rs.standard_normal((2, 3)), rs.standard_normal((4, 3))
    da, db = rs.standard_normal((2, 2)), rs.standard_normal((4, 2))
    w, bias = [blob.data for blob in net.params['ip_a']]
    out = net.forward(x=x, x2=x2)
    close(out['b'], x2 @ w.T + bias)
    net.clear_param_diffs()
    net.backward(a=da, b=db)
    close(net.params['ip_a'][0].diff, da.T @ x + db.T @ x2)
    close(net.params['ip_b'][1].diff, da.sum(0) + db.sum(0))

    def objective():
        out = net.forward(x=x, x2=x2)
        return float((da * out['a']).sum() + (db * out['b']).sum())
    close(net.params['ip_a'][0].diff, numeric_gradient(w, objective), rtol=1e-6, atol=1e-7)


def test_shared_params_need_equal_shapes_unless_permissive():
    with pytest.raises(CaffeError, match="ip_b.*shape"):
        build(shared_net(b_out=3))
    # PERMISSIVE: W (4, 6) of ip_a seen as (6, 4) by ip_b
    net = build(shared_net(a_out=4, b_out=6, b_in=4, spec_a='param { name: "w" }',
                           spec_b='param { name: "w" share_mode: PERMISSIVE }', bias=False)
                .replace('input_param { shape { dim: 2 dim: 3 }', 'input_param { shape { dim: 2 dim: 6 }'),
                dtype=np.float64)
    assert net.params['ip_b'][0].shape == (6, 4) and len(net.learnable_params) == 1
    randomize(net)
    rs = np.random.RandomState(9)
    x, x2 = rs.standard_normal((2, 6)), rs.standard_normal((4, 4))
    da, db = rs.standard_normal((2, 4)), rs.standard_normal((4, 6))
    w = net.params['ip_a'][0].data
    close(net.forward(x=x, x2=x2)['b'], x2 @ w.reshape(6, 4).T)
    net.clear_param_diffs()
    net.backward(a=da, b=db)
    close(net.params['ip_a'][0].diff, da.T @ x + (db.T @ x2).reshape(4, 6))
    with pytest.raises(CaffeError, match="ip_b.*15 values"):
        build(shared_net(a_out=4, b_out=5, b_in=3, spec_b='param { name: "w" share_mode: PERMISSIVE }'
                         ' param { name: "b2" }'))


def test_shared_param_multipliers_follow_caffe():
    net = build(shared_net(spec_b='param { name: "w" lr_mult: 2 } param { name: "b" decay_mult: 0 }'))
    assert net.params_lr == [2, 1] and net.params_weight_decay == [1, 0]
    with pytest.raises(CaffeError, match='lr_mult'):
        build(shared_net(spec_a='param { name: "w" lr_mult: 1 } param { name: "b" }',
                         spec_b='param { name: "w" lr_mult: 3 } param { name: "b" }'))


def test_more_param_specs_than_blobs_is_an_error():
    with pytest.raises(CaffeError, match="'ip'"):
        build(input_layer('x', 2, 3) + ip_layer('ip', 'x', 'y', 2, 'param {} param {} param {}'))


# ---- multipliers, loss weights and the backward rule ---------------------------------------
def test_lr_and_decay_mult():
    net = build(input_layer('x', 2, 3, 2, 2)
                + ip_layer('ip1', 'x', 'y', 4, 'param { lr_mult: 0.5 decay_mult: 2 } '
                           'param { lr_mult: 2 decay_mult: 0 }')
                + ip_layer('ip2', 'y', 'z', 3)
                + 'layer { name: "bn" type: "BatchNorm" bottom: "x" top: "n" }\n')
    assert net.params_lr == [0.5, 2, 1, 1, 0, 0, 0]          # BatchNorm's statistics never learn
    assert net.params_weight_decay == [2, 0, 1, 1, 1, 1, 1]


EUCLID = (input_layer('x', 3, 4) + input_layer('t', 3, 2) + ip_layer('ip', 'x', 'y', 2)
          + 'layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss" %s }\n')


@pytest.mark.parametrize('weight', [None, 2.5])
def test_loss_weight_of_a_loss_layer(weight):
    net = build(EUCLID % ('' if weight is None else 'loss_weight: %g' % weight), dtype=np.float64)
    randomize(net)
    w = 1.0 if weight is None else weight
    rs = np.random.RandomState(10)
    x, t = rs.standard_normal((3, 4)), rs.standard_normal((3, 2))
    net.blobs['x'].data[...], net.blobs['t'].data[...] = x, t
    net.clear_param_diffs()
    total = net.forward_backward()
    y = x @ net.params['ip'][0].data.T + net.params['ip'][1].data
    loss = ((y - t) ** 2).sum() / 6
    close(net.blobs['loss'].data, loss)                # the top holds the unweighted loss
    close(total, w * loss)
    close(net.blobs['loss'].diff, w)
    close(net.blobs['y'].diff, w * (y - t) / 3)
    close(net.params['ip'][0].diff, (w * (y - t) / 3).T @ x)
    assert np.all(net.blobs['t'].diff == 0)            # the target needs no gradient


def test_loss_weight_on_a_plain_top():
    net = build(input_layer('x', 3, 4) + ip_layer('ip', 'x', 'y', 2, 'loss_weight: 0.5'),
                dtype=np.float64)
    randomize(net)
    x = np.random.RandomState(11).standard_normal((3, 4))
    net.blobs['x'].data[...] = x
    net.clear_param_diffs()
    total = net.forward_backward()
    close(total, 0.5 * net.blobs['y'].data.sum())
    close(net.params['ip'][0].diff, 0.5 * np.ones((2, 3)) @ x)
    close(net.params['ip'][1].diff, [1.5, 1.5])


def test_loss_top_that_is_also_consumed_goes_through_a_split():
    net = build(input_layer('x', 3, 4) + input_layer('t', 3, 2) + ip_layer('ip', 'x', 'y', 2)
                + 'layer { name: "relu" type: "ReLU" bottom: "y" top: "r" loss_weight: 3 }\n'
                + 'layer { name: "loss" type: "EuclideanLoss" bottom: "r" bottom: "t" top: "loss" }\n',
                dtype=np.float64)
    assert net.top_names['r_relu_0_split'] == ['r_relu_0_split_0', 'r_relu_0_split_1']
    assert net.bottom_names['loss'] == ['r_relu_0_split_1', 't']
    assert net.outputs == ['loss', 'r_relu_0_split_0']
    randomize(net)
    rs = np.random.RandomState(12)
    x, t = rs.standard_normal((3, 4)), rs.standard_normal((3, 2))
    net.blobs['x'].data[...], net.blobs['t'].data[...] = x, t
    net.clear_param_diffs()
    total = net.forward_backward()
    y = x @ net.params['ip'][0].data.T + net.params['ip'][1].data
    r = np.maximum(y, 0)
    close(total, 3 * r.sum() + ((r - t) ** 2).sum() / 6)
    dr = 3 + (r - t) / 3
    close(net.blobs['r'].diff, dr)
    close(net.params['ip'][0].diff, (dr * (y > 0)).T @ x)


def test_propagate_down_stops_a_branch():
    text = (input_layer('x', 3, 4) + ip_layer('ip_a', 'x', 'a', 2) + ip_layer('ip_b', 'x', 'b', 2)
            + 'layer { name: "loss" type: "EuclideanLoss" bottom: "a" bottom: "b" top: "loss" '
              'propagate_down: true propagate_down: false }\n')
    net = build(text, dtype=np.float64)
    randomize(net)
    x = np.random.RandomState(13).standard_normal((3, 4))
    net.blobs['x'].data[...] = x
    net.clear_param_diffs()
    net.forward_backward()
    a, b = net.blobs['a'].data, net.blobs['b'].data
    close(net.params['ip_a'][0].diff, ((a - b) / 3).T @ x)
    assert all(np.all(blob.diff == 0) for blob in net.params['ip_b'])
    assert np.all(net.blobs['b'].diff == 0)
    with pytest.raises(CaffeError, match="'loss'.*propagate_down"):
        build(text.replace('propagate_down: false ', ''))


def test_force_backward():
    net = build(MLP)                                   # no loss: nothing runs backward
    randomize(net)
    net.forward(data=np.ones((2, 3, 2, 2)))
    assert np.all(net.backward(prob=np.ones((2, 4)))['data'] == 0)
    assert all(np.all(b.diff == 0) for blobs in net.params.values() for b in blobs)
    frozen = MLP.replace('inner_product_param { num_output: 5',
                         'param { lr_mult: 0 } param { lr_mult: 0 } inner_product_param { num_output: 5')
    frozen += 'layer { name: "loss" type: "EuclideanLoss" bottom: "prob" bottom: "ip2" top: "loss" }\n'
    for force, expect_grad in ((False, False), (True, True)):
        net = build(('force_backward: true\n' if force else '') + frozen)
        randomize(net)
        net.forward(data=np.ones((2, 3, 2, 2)))
        net.clear_param_diffs()
        net.backward()
        assert np.any(net.params['ip1'][0].diff != 0) == expect_grad      # lr_mult 0 params
        assert np.any(net.blobs['data'].diff != 0) == expect_grad
    net = build('force_backward: true\n' + input_layer('s', 2, 3) + input_layer('label', 2)
                + 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "label" top: "l" }')
    net.forward(s=np.ones((2, 3)), label=np.array([0, 2]))
    net.backward()                                     # labels are never differentiated
    assert np.all(net.blobs['label'].diff == 0) and np.any(net.blobs['s'].diff != 0)


@pytest.mark.parametrize('force', [False, True])
def test_only_layers_that_lead_to_a_loss_and_need_it_run_backward(pylayers, force):
    text = (input_layer('data', 2, 3) + python_layer('pa', 'data', 'a')
            + python_layer('pb', 'data', 'b')                           # leads to no loss
            + ip_layer('ip', 'a', 'c', 2) + ip_layer('ip_side', 'b', 'side', 2)
            + python_layer('loss', 'c', 'loss', 'SumSquares', extra='loss_weight: 1'))
    net = build(('force_backward: true\n' if force else '') + text)
    randomize(net)
    net.forward(data=np.ones((2, 3)))
    net.clear_param_diffs()
    net.backward()
    if force:
        assert sorted(backward_calls(pylayers)) == [('loss', [True]), ('pa', [True]), ('pb', [True])]
    else:                  # pa: no params and its bottom needs no gradient; pb: no loss above
        assert backward_calls(pylayers) == [('loss', [True])]
        assert all(np.all(blob.diff == 0) for blob in net.params['ip_side'])
        assert np.all(net.blobs['a'].diff == 0)
    assert np.any(net.params['ip'][0].diff != 0)


def test_frozen_layer_without_gradient_below_skips_backward(pylayers):
    text = (input_layer('data', 2, 3) + python_layer('p', 'data', 'a')
            + ip_layer('ip', 'a', 'c', 2, 'param { lr_mult: 0 } param { lr_mult: 0 }')
            + python_layer('loss', 'c', 'loss', 'SumSquares', extra='loss_weight: 1'))
    net = build(text)
    net.forward(data=np.ones((2, 3)))
    net.backward()
    assert backward_calls(pylayers) == []              # nothing below the loss can learn
    del pylayers.CALLS[:]
    learned_below = text.replace(python_layer('p', 'data', 'a'),
                                 ip_layer('ip0', 'data', 'a0', 3) + python_layer('p', 'a0', 'a'))
    net = build(learned_below)
    net.forward(data=np.ones((2, 3)))
    net.backward()
    assert backward_calls(pylayers) == [('loss', [True]), ('p', [True])]
    del pylayers.CALLS[:]
    stopped = learned_below.replace('loss_weight: 1', 'loss_weight: 1 propagate_down: false')
    net = build(stopped)
    net.forward(data=np.ones((2, 3)))
    net.clear_param_diffs()
    net.backward()
    # the loss runs without propagating; the layers below all feed skipped blobs only
    assert backward_calls(pylayers) == [('loss', [False])]
    assert np.all(net.params['ip0'][0].diff == 0)


# ---- the whole net against finite differences ------------------------------------------------
def test_net_gradient_matches_finite_differences():
    """Split, in-place, shared weights and two weighted losses, all at once, in float64."""
    text = ('force_backward: true\n' + input_layer('x', 3, 4) + input_layer('t', 3, 3)
            + ip_layer('ip1', 'x', 'h', 3, 'param { name: "w" } param { name: "b" }')
            + 'layer { name: "act" type: "TanH" bottom: "h" top: "h" }\n'
            + ip_layer('ip2', 'h', 'g', 3, 'param { name: "w2" }')
            + ip_layer('ip3', 'g', 'k', 3, 'param { name: "w2" } param { name: "b3" }')
            + 'layer { name: "l1" type: "EuclideanLoss" bottom: "k" bottom: "t" top: "l1" '
              'loss_weight: 0.7 }\n'
            + 'layer { name: "l2" type: "EuclideanLoss" bottom: "h" bottom: "g" top: "l2" }\n')
    net = build(text, dtype=np.float64)
    randomize(net)
    rs = np.random.RandomState(15)
    net.blobs['x'].data[...] = rs.standard_normal((3, 4))
    net.blobs['t'].data[...] = rs.standard_normal((3, 3))
    net.clear_param_diffs()
    net.forward_backward()
    analytic = {'x': net.blobs['x'].diff.copy()}
    analytic.update({'%s/%d' % (name, i): b.diff.copy() for name, blobs in net.params.items()
                     for i, b in enumerate(blobs)})
    for key, grad in analytic.items():
        target = net.blobs['x'] if key == 'x' else net.params[key.split('/')[0]][int(key[-1])]
        numeric = numeric_gradient(target.data, net.forward_prefilled)
        close(grad, numeric, rtol=1e-6, atol=1e-7)
