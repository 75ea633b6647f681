"""The corpus deploy nets through every export, against our forward on the same weights.

ResNet-50, AlexNet, CaffeNet, VGG FCN-8s and PSPNet-50 at 473, with random weights and
batch-norm statistics calibrated on their input (model_weights.py), each within 1e-4
relative plus 1e-5 x max|ours| absolute:
  to-onnx, run by onnxruntime;
  fold-bn, run by us and by OpenCV 4's independent Caffe importer;
  to-batchnorm of the net's SyncBN form (to-syncbn), run by OpenCV.
One test per net: its reference forward is the costly part.
"""
import pytest

from caffe_syncbn.convert import fold_bn, to_batchnorm, to_syncbn
from caffe_syncbn.cli.convert import write_net
from helpers.model_weights import Deployed

cv2 = pytest.importorskip('cv2', reason='OpenCV is absent: pip install "opencv-python-headless<5"')
pytest.importorskip('onnxruntime', reason='the ONNX export runs in onnxruntime: '
                                          "pip install '.[onnx]' onnxruntime")
from caffe_syncbn.export import to_onnx  # noqa: E402  (after the skips)
from helpers.onnx_helpers import run  # noqa: E402

NETS = {   # AlexNet's and CaffeNet's batch is 10, FCN-8s takes any size: smaller is quicker
    'resnet50': ('KaimingHe_deep-residual-networks__prototxt_ResNet-50-deploy.prototxt', None),
    'alexnet': ('BVLC_caffe__models_bvlc_alexnet_deploy.prototxt', (2, 3, 227, 227)),
    'caffenet': ('BVLC_caffe__models_bvlc_reference_caffenet_deploy.prototxt', (2, 3, 227, 227)),
    'fcn8s': ('shelhamer_fcn.berkeleyvision.org__voc-fcn8s_deploy.prototxt', (1, 3, 256, 256)),
    'pspnet50': ('hszhao_PSPNet__evaluation_prototxt_pspnet50_ADE20K_473.prototxt', None),
}
SLOW = {'alexnet', 'caffenet', 'fcn8s', 'pspnet50'}


def opencv(tmp_path, deployed, param, weights):
    paths = write_net(str(tmp_path / 'export'), param, weights)
    net = cv2.dnn.readNetFromCaffe(*paths)
    # OpenCV's Winograd 3x3 convolutions have several times the float32 error of a direct
    # one: on PSPNet-50 that alone breaks the tolerance, whatever the export
    net.enableWinograd(False)
    net.setInput(deployed.x)
    names = sorted(deployed.expected)
    return dict(zip(names, net.forward(names)))


@pytest.mark.parametrize('key', [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k
                                 for k in NETS])
def test_corpus_net_exports(key, tmp_path):
    name, shape = NETS[key]
    deployed = Deployed(name, shape)
    model = to_onnx(deployed.param, deployed.weights, input_shapes=deployed.input_shapes)
    deployed.check(run(model, {deployed.input: deployed.x}), 'to-onnx, onnxruntime')
    param, weights = fold_bn(deployed.param, deployed.weights)
    assert not {'BatchNorm', 'BN', 'SyncBN', 'Scale'} & {layer.type for layer in param.layer}
    deployed.check(deployed.forward(param, weights), 'fold-bn, ours')
    deployed.check(opencv(tmp_path, deployed, param, weights), 'fold-bn, OpenCV')
    synced = to_syncbn(deployed.param, deployed.weights)
    deployed.check(deployed.forward(*synced), 'to-syncbn, ours')
    param, weights = to_batchnorm(*synced)
    deployed.check(opencv(tmp_path, deployed, param, weights), 'to-batchnorm, OpenCV')
