"""The rest of the pycaffe module: caffe.draw (DOT text, and images through graphviz-pure or
Graphviz), the solvers' pycaffe methods, Detector's context crops, install_as_caffe and the
process-wide helpers."""
import logging
import sys

import numpy as np
import pytest
from helpers import watchdog

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.netparam.prototxt import parse_text
from caffe_syncbn.pycaffe import draw, runtime

from helpers.paths import CORPUS, ROOT, require

TRAIN_VAL = """name: 'tiny'
layer { name: 'data' type: 'Data' top: 'data' top: 'label' include { phase: TRAIN }
        data_param { source: 'x' batch_size: 64 } }
layer { name: 'data' type: 'Input' top: 'data' top: 'label' include { phase: TEST }
        input_param { shape { dim: 2 dim: 1 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: 'conv|1' type: 'Convolution' bottom: 'data' top: 'conv1'
        param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 4 kernel_size: 3 stride: 2 pad: 1 } }
layer { name: 'relu1' type: 'ReLU' bottom: 'conv1' top: 'conv1' }
layer { name: 'pool1' type: 'Pooling' bottom: 'conv1' top: 'pool1'
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'pool1' top: 'ip' inner_product_param { num_output: 3 } }
layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss'
        exclude { phase: TEST } }
"""


def net_param(text=TRAIN_VAL):
    return parse_text(text, caffe_pb2.NetParameter())


# ---- draw -----------------------------------------------------------------------------------
def test_dot_source_labels_edges_and_phases():
    source = draw.get_dot_source(net_param(), 'LR', display_lrm=True)
    assert r'label="conv\|1\n(Convolution)\nkernel size: 3\nstride: 2\npad: 1\nlr mult: 1.0, 2.0"' in source
    assert r'label="pool1\n(Pooling AVE)\nkernel size: 2\nstride: 2\npad: 0"' in source
    assert '"layer2" -> "blob_conv1" [label="4"];' in source           # num_output on the edge
    assert '"layer0" -> "blob_data" [label="Batch 64"];' in source
    assert 'fillcolor="#90EE90"' in source                             # in-place ReLU
    assert source.count('shape="octagon"') == 6       # data label conv1 pool1 ip loss
    vertical = draw.get_dot_source(net_param(), 'TB')
    assert r'label="pool1 (Pooling AVE) kernel size: 2 stride: 2 pad: 0"' in vertical
    assert 'lr mult' not in vertical
    test_only = draw.get_dot_source(net_param(), 'LR', phase=caffe.TEST)
    assert '(Data)' not in test_only and '(Input)' in test_only and 'SoftmaxWithLoss' not in test_only
    assert 'Batch 64' in draw.get_dot_source(net_param(), 'LR', phase=caffe.TRAIN)
    both = net_param(TRAIN_VAL.replace("exclude { phase: TEST }", "exclude { phase: TEST } include { phase: TRAIN }"))
    with pytest.raises(CaffeError, match='both include and exclude'):
        draw.get_dot_source(both, 'LR', phase=caffe.TRAIN)


def test_pydot_graph_and_text_files(tmp_path):
    pydot = pytest.importorskip('pydot')
    graph = draw.get_pydot_graph(net_param(), 'LR')
    assert isinstance(graph, pydot.Dot) and len(graph.get_edges()) == 15
    draw.draw_net_to_file(net_param(), str(tmp_path / 'net.dot'))
    assert (tmp_path / 'net.dot').read_text() == draw.get_dot_source(net_param(), 'LR')
    v1 = 'name: "v1" layers { name: "ip" type: INNER_PRODUCT bottom: "x" top: "y" }'
    assert '(InnerProduct)' in draw.draw_net(net_param(v1), 'LR', ext='raw').decode()


def test_draw_images(tmp_path):
    try:
        draw.dot_program()
    except CaffeError:
        pytest.skip('neither Graphviz dot nor graphviz-pure is installed')
    deploy = require(CORPUS / 'BVLC_caffe__models_bvlc_alexnet_deploy.prototxt')
    png, svg = tmp_path / 'alexnet.png', tmp_path / 'alexnet.svg'
    draw.draw_net_to_file(str(deploy), str(png), rankdir='TB')
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and png.stat().st_size > 10000
    draw.draw_net_to_file(net_param(), str(svg), phase=caffe.TRAIN, display_lrm=True)
    text = svg.read_text()
    assert '<svg' in text and 'conv|1' in text and 'lr mult: 1.0, 2.0' in text
    with pytest.raises(CaffeError, match='could not draw the net'):
        draw.draw_net(net_param(), 'LR', ext='no-such-format')


def test_draw_with_the_pycaffe_call(tmp_path):
    # what pycaffe's python/draw_net.py does, through the installed `caffe` module
    script = ('import caffe_syncbn; caffe_syncbn.install_as_caffe()\n'
              'import sys, caffe, caffe.draw\n'
              'from caffe.proto import caffe_pb2\n'
              'from google.protobuf import text_format\n'
              'net = caffe_pb2.NetParameter()\n'
              'text_format.Merge(open(sys.argv[1]).read(), net)\n'
              'caffe.draw.draw_net_to_file(net, sys.argv[2], "LR", caffe.TEST, False)\n')
    (tmp_path / 'net.prototxt').write_text(TRAIN_VAL)
    out = tmp_path / 'net.gv'
    watchdog.run([sys.executable, '-c', script, str(tmp_path / 'net.prototxt'), str(out)], check=True,
                 env={'PYTHONPATH': str(ROOT), 'PATH': ''}, limit=120)
    assert out.read_text() == draw.get_dot_source(net_param(), 'LR', phase=caffe.TEST)


# ---- solvers --------------------------------------------------------------------------------
SOLVER_NET = """name: 'reg'
layer { name: 'data' type: 'Input' top: 'x' top: 'y' input_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 } } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'ip'
        inner_product_param { num_output: 2 weight_filler { type: 'gaussian' std: 0.5 } } }
layer { name: 'loss' type: 'EuclideanLoss' bottom: 'ip' bottom: 'y' top: 'loss' }
"""


def solver_text(tmp_path):
    (tmp_path / 'net.prototxt').write_text(SOLVER_NET)
    return ("net: '%s' base_lr: 0.1 lr_policy: 'step' gamma: 0.5 stepsize: 2 max_iter: 4 "
            "type: 'Nesterov' momentum: 0.9 snapshot_prefix: '%s' "
            "test_iter: 1 test_interval: 100 test_initialization: false"
            % (tmp_path / 'net.prototxt', tmp_path / 'snap'))


def test_get_solver_from_string_callbacks_and_snapshots(tmp_path):
    solver = caffe.get_solver_from_string(solver_text(tmp_path))
    assert type(solver).__name__ == 'NesterovSolver' and len(solver.test_nets) == 1
    solver.net.blobs['x'].data[...] = np.random.RandomState(0).randn(4, 3)
    events = []
    weights = solver.net.params['ip'][0].data

    def on_gradients_ready():
        events.append(('ready', solver.iter, weights.copy(), solver.net.params['ip'][0].diff.copy()))

    solver.add_callback(lambda: events.append(('start', solver.iter)), on_gradients_ready)
    solver.step(3)
    assert [e[:2] for e in events] == [('start', 0), ('ready', 0), ('start', 1), ('ready', 1),
                                      ('start', 2), ('ready', 2)]
    assert events[1][3].any() and not np.array_equal(events[1][2], events[3][2])  # before updates
    assert solver.iter == 3 and solver.lr == pytest.approx(0.05)
    solver.test_nets[0].params['ip'][0].data[...] = 0          # share_weights undoes this
    solver.share_weights(solver.test_nets[0])
    np.testing.assert_array_equal(solver.test_nets[0].params['ip'][0].data, weights)
    model, state = solver.snapshot()
    solver.solve()
    assert solver.iter == 4
    again = caffe.NesterovSolver(str(_write(tmp_path / 's.prototxt', solver_text(tmp_path))))
    again.restore(state)
    assert again.iter == 3
    with pytest.raises(CaffeError, match=r'<solver string>:1:\d+'):
        caffe.get_solver_from_string('base_lr: 0.1 typo {')


def _write(path, text):
    path.write_text(text)
    return path


def test_nccl_for_one_solver_and_data_parallel_callbacks(tmp_path):
    solver = caffe.get_solver_from_string(solver_text(tmp_path))
    assert not runtime.has_nccl() and isinstance(runtime.NCCL.new_uid(), bytes)
    nccl = runtime.NCCL(solver, runtime.NCCL.new_uid())
    nccl.bcast()
    solver.add_callback(nccl)
    solver.step(1)
    runtime.set_solver_count(2)
    try:
        with pytest.raises(CaffeError, match="devices='gpu:0,1"):
            runtime.NCCL(solver, b'uid')
    finally:
        runtime.set_solver_count(1)
    parallel = caffe.get_solver(str(_write(tmp_path / 's.prototxt', solver_text(tmp_path))),
                                devices='cpu:1')
    try:
        with pytest.raises(CaffeError, match='single-device solvers'):
            parallel.add_callback(lambda: None, lambda: None)
    finally:
        parallel.close()


# ---- Detector --------------------------------------------------------------------------------
def test_detector_context_crop(tmp_path):
    (tmp_path / 'det.prototxt').write_text(
        "layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 1 dim: 3 dim: 20 dim: 20 } } }\n"
        "layer { name: 'ip' type: 'InnerProduct' bottom: 'data' top: 'ip' inner_product_param { num_output: 2 } }\n"
        "layer { name: 'prob' type: 'Softmax' bottom: 'ip' top: 'prob' }\n")
    detector = caffe.Detector(str(tmp_path / 'det.prototxt'), None, mean=np.array([30.0, 60.0, 90.0]),
                              raw_scale=255, channel_swap=(2, 1, 0), context_pad=2)
    np.testing.assert_allclose(detector.crop_mean[0, 0], [90 / 255, 60 / 255, 30 / 255])  # RGB, [0, 1]
    image = np.random.RandomState(0).rand(60, 50, 3).astype(np.float32)
    window = np.array([10, 12, 29, 31])          # 20 x 20, inclusive corners
    crop = detector.crop(image, window)
    # 20 pixels of window plus 2 * 2 of context on each axis of a 20-pixel input: scale 20/16
    # enlarges the box to 25 x 25 around the same centre, which lies inside the image
    np.testing.assert_allclose(crop, caffe.io.resize_image(image[8:32, 10:34], (20, 20)),
                               atol=1e-6)
    corner = detector.crop(image, np.array([0, 0, 19, 19]))
    np.testing.assert_allclose(corner[0, 0], detector.crop_mean[0, 0])  # outside the image: the mean
    plain = caffe.Detector(str(tmp_path / 'det.prototxt'), None)
    np.testing.assert_array_equal(plain.crop(image, window), image[10:29, 12:31])


# ---- install and process-wide helpers ------------------------------------------------------------
def test_install_as_caffe_in_a_fresh_interpreter(tmp_path):
    script = ('import caffe_syncbn; mod = caffe_syncbn.install_as_caffe()\n'
              'import caffe, caffe.io, caffe.draw, caffe.coord_map, caffe.net_spec\n'
              'from caffe import layers as L, params as P\n'
              'from caffe.proto import caffe_pb2\n'
              'import caffe.proto.caffe_pb2\n'
              'assert caffe is mod and caffe_pb2 is caffe_syncbn.caffe_pb2\n'
              'assert caffe.Net is caffe_syncbn.Net and caffe.TRAIN == 0 and caffe.TEST == 1\n'
              'assert P.Pooling.MAX == 0 and L.ReLU is not None and caffe.io.Transformer\n'
              'assert caffe.Classifier.__mro__[1] is caffe.Net and caffe.Detector\n'
              'for name in ["get_solver", "SGDSolver", "AdamSolver", "NetSpec", "to_proto", "layer_type_list",\n'
              '             "set_mode_cpu", "set_device", "set_random_seed", "Layer", "init_log", "log",\n'
              '             "Timer", "NCCL", "has_nccl", "solver_count", "set_solver_count", "solver_rank",\n'
              '             "set_solver_rank", "set_multiprocess", "__version__", "get_solver_from_string"]:\n'
              '    getattr(caffe, name)\n'
              'print("ok")\n')
    result = watchdog.run([sys.executable, '-c', script], capture_output=True, text=True,
                          env={'PYTHONPATH': str(ROOT)}, limit=120)
    assert result.stdout.strip() == 'ok', result.stderr[-2000:]

    (tmp_path / 'caffe.py').write_text('# another caffe\n')
    clash = 'import caffe, caffe_syncbn; caffe_syncbn.install_as_caffe()'
    result = watchdog.run([sys.executable, '-c', clash], capture_output=True, text=True,
                          env={'PYTHONPATH': '%s:%s' % (tmp_path, ROOT)}, limit=120)
    assert result.returncode == 1 and 'another module named caffe is already imported' in result.stderr


def test_timer_and_logging(caplog):
    timer = runtime.Timer()
    assert timer.ms == 0.0
    timer.start()
    timer.stop()
    first = timer.ms
    assert 0 <= first < 1000 and timer.ms == first          # stopped: the reading stays
    logger = logging.getLogger('caffe_syncbn')
    saved = logger.handlers[:], logger.level, logger.propagate
    try:
        runtime.init_log(1)
        assert logger.level == logging.WARNING
        with pytest.raises(CaffeError):
            runtime.init_log(7)
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    with caplog.at_level(logging.INFO, logger='caffe_syncbn'):
        runtime.log('hello from a script')
    assert 'hello from a script' in caplog.text
