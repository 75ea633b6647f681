"""The Caffe schema: proto/caffe.proto, caffe_syncbn/caffe.pb and caffe_pb2."""
import importlib.util
import subprocess
import sys

import pytest
from google.protobuf import text_format

from caffe_syncbn import caffe_pb2

from helpers.paths import CORPUS, GOLDEN, ROOT, require


def _files(folder, pattern):
    if not folder.is_dir():
        return []
    return sorted(folder.glob(pattern))


# --- the generated descriptor is in sync with the .proto ---------------------

def test_caffe_pb_is_up_to_date():
    if importlib.util.find_spec('grpc_tools') is None:
        pytest.skip('grpcio-tools is not installed; cannot regenerate caffe.pb')
    result = subprocess.run([sys.executable, str(ROOT / 'tools' / 'gen_proto.py'), '--check'],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- module surface, like pycaffe's caffe_pb2 ---------------------------------

def test_module_surface():
    net = caffe_pb2.NetParameter()
    net.layer.add(name='conv', type='Convolution').convolution_param.num_output = 3
    assert net.layer[0].convolution_param.num_output == 3
    assert (caffe_pb2.TRAIN, caffe_pb2.TEST) == (0, 1)
    assert caffe_pb2.Phase.Name(caffe_pb2.TEST) == 'TEST'
    assert caffe_pb2.V1LayerParameter.CONVOLUTION == 4
    assert caffe_pb2.V1LayerParameter.LayerType.Value('SOFTMAX_LOSS') == 21
    assert caffe_pb2.PoolingParameter.MAX == 0
    assert caffe_pb2.PoolingParameter.FLOOR == 1
    assert caffe_pb2.SolverParameter.ADAM == 5
    assert caffe_pb2.BNParameter.CUDNN == 2


def test_defaults():
    assert caffe_pb2.SolverParameter().type == 'SGD'
    assert caffe_pb2.SolverParameter().solver_mode == caffe_pb2.SolverParameter.GPU
    assert caffe_pb2.SolverParameter().snapshot_format == caffe_pb2.SolverParameter.BINARYPROTO
    assert caffe_pb2.NetState().phase == caffe_pb2.TEST
    assert caffe_pb2.PoolingParameter().round_mode == caffe_pb2.PoolingParameter.CEIL
    assert caffe_pb2.FillerParameter().type == 'constant'
    assert caffe_pb2.LossParameter().normalization == caffe_pb2.LossParameter.VALID
    bn = caffe_pb2.BNParameter()
    assert bn.momentum == pytest.approx(0.9)
    assert bn.eps == pytest.approx(1e-5)
    assert not bn.frozen
    interp = caffe_pb2.InterpParameter()
    assert (interp.zoom_factor, interp.shrink_factor, interp.pad_beg, interp.pad_end) == (1, 1, 0, 0)


# --- field numbers ----------------------------------------------------------

def _number(message, field):
    return getattr(caffe_pb2, message).DESCRIPTOR.fields_by_name[field].number


@pytest.mark.parametrize('message, field, number', [
    ('LayerParameter', 'embed_param', 137),
    ('LayerParameter', 'input_param', 143),
    ('LayerParameter', 'batch_norm_param', 139),
    ('LayerParameter', 'convolution_param', 106),
    ('LayerParameter', 'clip_param', 148),
    ('LayerParameter', 'transform_param', 100),
    ('NetParameter', 'layer', 100),
    ('NetParameter', 'layers', 2),
    ('SolverParameter', 'type', 40),
    ('SolverParameter', 'weights', 42),
    ('PoolingParameter', 'round_mode', 13),
    ('V1LayerParameter', 'blobs_lr', 7),
    ('V1LayerParameter', 'weight_decay', 8),
    ('BNParameter', 'slope_filler', 1),
    ('BNParameter', 'frozen', 5),
    ('InterpParameter', 'pad_end', 6),
    ('TransformationParameter', 'scale_ratios', 12),
    ('TransformationParameter', 'stride', 16),
    # NVCaffe, R-FCN, caffe-fast-rcnn, chuanqi305/ssd, at their numbers
    ('BatchNormParameter', 'scale_filler', 5),
    ('BatchNormParameter', 'bias_filler', 6),
    ('BatchNormParameter', 'scale_bias', 7),
    ('BatchNormParameter', 'engine', 15),
    ('BlobProto', 'raw_data_type', 10),
    ('BlobProto', 'raw_diff_type', 11),
    ('BlobProto', 'raw_data', 12),
    ('BlobProto', 'raw_diff', 13),
    ('PoolingParameter', 'torch_pooling', 40),
    ('PoolingParameter', 'ceil_mode', 1013),     # 13 in its forks: BVLC's round_mode here
    ('DropoutParameter', 'scale_train', 2),
    ('LayerParameter', 'relu6_param', 208),
    ('LayerParameter', 'psroi_pooling_param', 10001),
    ('PSROIPoolingParameter', 'group_size', 3),
])
def test_field_number(message, field, number):
    assert _number(message, field) == number


def test_fork_fields_do_not_collide():
    fields = caffe_pb2.LayerParameter.DESCRIPTOR.fields
    numbers = [f.number for f in fields]
    assert len(numbers) == len(set(numbers))
    for name in ('bn_param', 'interp_param', 'seg_data_param'):
        number = _number('LayerParameter', name)
        assert [f.name for f in fields if f.number == number] == [name]
        assert number > 1000  # outside the range BVLC and the forks used
    transform = caffe_pb2.TransformationParameter.DESCRIPTOR.fields
    assert len({f.number for f in transform}) == len(transform)


# --- real-world files ---------------------------------------------------------

CORPUS_FILES = _files(CORPUS, '*.prototxt')


@pytest.mark.parametrize('path', CORPUS_FILES, ids=[p.name for p in CORPUS_FILES])
def test_corpus_prototxt_parses(path):
    kind = caffe_pb2.SolverParameter if 'solver' in path.name else caffe_pb2.NetParameter
    message = text_format.Parse(path.read_text(), kind())
    assert message.ListFields()


def test_corpus_present():
    require(CORPUS)
    assert CORPUS_FILES


GOLDEN_TEXT = _files(GOLDEN, '*.prototxt')


@pytest.mark.parametrize('path', GOLDEN_TEXT, ids=[p.name for p in GOLDEN_TEXT])
def test_golden_prototxt_parses(path):
    kind = caffe_pb2.SolverParameter if path.name.endswith('.solver.prototxt') else caffe_pb2.NetParameter
    text_format.Parse(path.read_text(), kind())


def test_psp_caffemodel_parses():
    model = GOLDEN / 'psp_ppm_train.caffemodel'
    if not model.exists():
        pytest.skip('%s is absent' % model)
    np = pytest.importorskip('numpy')
    net = caffe_pb2.NetParameter.FromString(model.read_bytes())
    layers = {layer.name: layer for layer in net.layer}

    # Every layer of the prototxt is there, with its type (the fork also
    # saved its auto-inserted Split layers).
    spec = text_format.Parse((GOLDEN / 'psp_ppm_train.prototxt').read_text(),
                             caffe_pb2.NetParameter())
    for layer in spec.layer:
        assert layers[layer.name].type == layer.type
    assert sum(layer.type == 'Interp' for layer in net.layer) == 4
    assert sum(layer.type == 'BN' for layer in net.layer) == 4

    # Blob counts and shapes agree with the params recorded by the fork.
    recorded = np.load(GOLDEN / 'psp_ppm_train.npz')
    shapes = {}
    for key in recorded.files:
        if key.startswith('param_after/'):
            name, index = key[len('param_after/'):].rsplit('/', 1)
            shapes.setdefault(name, {})[int(index)] = recorded[key].shape
    assert shapes
    for layer in net.layer:
        expected = shapes.get(layer.name, {})
        assert len(layer.blobs) == len(expected), layer.name
        for i, blob in enumerate(layer.blobs):
            assert tuple(blob.shape.dim) == expected[i], (layer.name, i)
        if layer.type == 'BN':
            assert len(layer.blobs) == 4


def test_v1_caffemodel_and_solverstate_parse():
    v1 = GOLDEN / 'format_v1_caffemodel.v1.caffemodel'
    state = GOLDEN / 'solver_snapshot_binaryproto_iter_6.solverstate'
    if not (v1.exists() and state.exists()):
        pytest.skip('legacy golden files are absent')
    net = caffe_pb2.NetParameter.FromString(v1.read_bytes())
    assert net.layers and not net.layer
    assert any(layer.blobs for layer in net.layers)
    solver_state = caffe_pb2.SolverState.FromString(state.read_bytes())
    assert solver_state.iter == 6
    assert solver_state.history
