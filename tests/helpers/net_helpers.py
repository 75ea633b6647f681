"""Small nets as prototxt text, and the checks that tests/test_net*.py share."""
from pathlib import Path

import numpy as np
from google.protobuf import text_format

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2

HERE = Path(__file__).resolve().parent


def build(text, phase=caffe.TRAIN, dtype=np.float32, **kwargs):
    return caffe.Net(text_format.Parse(text, caffe_pb2.NetParameter()), phase, dtype=dtype, **kwargs)


def randomize(net, seed=0):
    rs = np.random.RandomState(seed)
    for blobs in net.params.values():
        for blob in blobs:
            blob.data[...] = rs.standard_normal(blob.shape)


def input_layer(top, *shape):
    return 'layer { name: "%s" type: "Input" top: "%s" input_param { shape { %s } } }\n' % (
        top, top, ' '.join('dim: %d' % d for d in shape))


def ip_layer(name, bottom, top, num_output, extra='', bias=True):
    return ('layer { name: "%s" type: "InnerProduct" bottom: "%s" top: "%s" %s '
            'inner_product_param { num_output: %d bias_term: %s } }\n'
            % (name, bottom, top, extra, num_output, 'true' if bias else 'false'))


MLP = (input_layer('data', 2, 3, 2, 2) + ip_layer('ip1', 'data', 'ip1', 5)
       + 'layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }\n'
       + ip_layer('ip2', 'ip1', 'ip2', 4)
       + 'layer { name: "prob" type: "Softmax" bottom: "ip2" top: "prob" }\n')


def mlp_reference(params, x, dprob=None):
    """Forward (and backward from ``dprob``) of MLP in numpy: (outputs, grads) dicts."""
    (w1, b1), (w2, b2) = [[b.data.astype(np.float64) for b in params[k]] for k in ('ip1', 'ip2')]
    x2 = x.reshape(len(x), -1).astype(np.float64)
    pre = x2 @ w1.T + b1
    h = np.maximum(pre, 0)
    z = h @ w2.T + b2
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    out = {'pre': pre, 'h': h, 'ip2': z, 'prob': p}
    if dprob is None:
        return out, None
    dz = p * (dprob - (dprob * p).sum(1, keepdims=True))
    dh_out = dz @ w2
    dpre = dh_out * (pre > 0)
    grads = {'ip2': dz, 'ip1_out': dh_out, 'ip1': dpre, 'data': (dpre @ w1).reshape(x.shape),
             'ip1/0': dpre.T @ x2, 'ip1/1': dpre.sum(0), 'ip2/0': dz.T @ h, 'ip2/1': dz.sum(0)}
    return out, grads


def close(actual, expected, rtol=1e-4, atol=1e-5):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)


def python_layer(name, bottom, top, layer='Multiply', param_str='', extra=''):
    return ('layer { name: "%s" type: "Python" bottom: "%s" top: "%s" %s python_param { '
            'module: "pylayer_examples" layer: "%s" param_str: \'%s\' } }\n'
            % (name, bottom, top, extra, layer, param_str))


def load_pylayers(monkeypatch):
    """helpers/pylayer_examples.py, imported from sys.path as Caffe imports Python layers."""
    monkeypatch.syspath_prepend(str(HERE))
    import pylayer_examples
    del pylayer_examples.CALLS[:]
    return pylayer_examples


def backward_calls(pylayers):
    return [call[1:] for call in pylayers.CALLS if call[0] == 'backward']
