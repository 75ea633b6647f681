"""What the ONNX export tests share: running a model in onnxruntime, the comparison, the
opsets to test, and prototxt snippets."""
import numpy as np
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2


def highest_common_opset():
    """The newest opset that the installed onnx knows and onnxruntime loads."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info('x', TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info('y', TensorProto.FLOAT, [1])
    for opset in range(onnx.defs.onnx_opset_version(), 17, -1):
        graph = helper.make_graph([helper.make_node('Relu', ['x'], ['y'])], 'probe', [x], [y])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', opset)])
        try:
            ort.InferenceSession(model.SerializeToString(), providers=['CPUExecutionProvider'])
            return opset
        except Exception:           # onnxruntime refuses opsets it does not know
            continue
    return 17


def run(model, feeds):
    """{output name: array} of ``model`` in onnxruntime."""
    import onnxruntime as ort
    session = ort.InferenceSession(model.SerializeToString(), providers=['CPUExecutionProvider'])
    names = [o.name for o in session.get_outputs()]
    feeds = {k: np.asarray(v, np.float32) for k, v in feeds.items()}
    return dict(zip(names, session.run(names, feeds)))


def assert_close(actual, expected, what):
    """rtol 1e-4, atol 1e-5 x max(1, max |reference|)."""
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, '%s: shape %s, expected %s' % (
        what, actual.shape, expected.shape)
    scale = max(1.0, float(np.abs(expected).max())) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * scale, err_msg=what)


def parse(text):
    return text_format.Parse(text, caffe_pb2.NetParameter())


def input_layer(top, *shape):
    return 'layer { name: "%s" type: "Input" top: "%s" input_param { shape { %s } } }\n' % (
        top, top, ' '.join('dim: %d' % d for d in shape))


def weights_of(net):
    return {name: [np.array(b.data) for b in blobs] for name, blobs in net.params.items()}
