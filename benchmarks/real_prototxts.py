"""Real public prototxts from other repositories (benchmarks/real_prototxts, their sources
and commits in its SOURCES.tsv): how many build and run forward here, and the one line each
of the others stops with.

    python benchmarks/real_prototxts.py [--out FOLDER] [--label NAME] [NAME_PART ...]

Each net is loaded, its data layers swapped for Input layers, built in TEST, given random
weights (fan-in scaled, batch norms calibrated on their input, as tests/helpers/model_weights
does) and run forward at batch 1, at a small input where the net allows. Each runs in a
process of its own, so that a crash stays there. A result is
  OK        the forward ran and every output is finite
  ERROR     one CaffeError line (recorded as it is)
  DEFECT    anything else: a traceback, another exception, a multi-line error, a crash,
            an output that is not finite
  TIMEOUT   no answer within TIMEOUT_S
The table goes to FOLDER/results_<label>.tsv (out/real_prototxts/ and the branch, by
default); NAME_PART runs the nets whose file names hold it.
None of these nets is in ../shared/corpus or tests/fork_corpus: they were chosen to span
segmentation, detection, classification, pose, faces, OCR and super-resolution, and the
forks those nets come from (docs/benchmarks.md, "Real prototxts").
"""
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
NETS = HERE / 'real_prototxts'
TIMEOUT_S = 900

#: input shapes by a part of the file name; nets not named run at their own (batch 1)
SHAPES = {
    'bvlc_googlenet': {'data': (1, 3, 224, 224)},
    'openpose__models_pose_coco': {'image': (1, 3, 96, 96)},
    'openpose__models_pose_body_25': {'image': (1, 3, 96, 96)},
    'bayesian_segnet_camvid': {'data': (1, 3, 360, 480)},
    'segnet_inference': {'data': (1, 3, 360, 480), 'label': (1, 1, 360, 480)},
    'ENet__prototxts_enet_deploy': {'data': (1, 3, 64, 128)},
    'VDSR': {'data': (1, 1, 64, 64)},
    'SqueezeNet': {'data': (1, 3, 227, 227)},
    'yoloV2Tiny20': {'data': (1, 3, 224, 224)},
    'yolov2_tiny_3': {'data': (1, 3, 224, 224)},
    'pose_deploy_centerMap': {'data': (1, 4, 128, 128)},
    'air101': {'data': (1, 3, 224, 224)},
    'deeplab-public-ver2': {'data': (1, 3, 65, 65), 'label': (1, 1, 65, 65),
                            'data_dim': (1, 1, 1, 2)},
    'DeepLab-Context': {'data': (1, 3, 65, 65)},
    'fcn.berkeleyvision': {'data': (1, 3, 64, 64), 'label': (1, 1, 64, 64), 'sem': (1, 1, 64, 64),
            'geo': (1, 1, 64, 64)},
}

#: domain and fork (or 'BVLC') of each net, by a part of its file name
KINDS = [
    ('fcn.berkeleyvision', 'segmentation', 'BVLC (FCN)'),
    ('PSPNet', 'segmentation', "PSPNet's Caffe"),
    ('ICNet', 'segmentation', "PSPNet's Caffe (ICNet)"),
    ('DeepLab-Context', 'segmentation', 'DeepLab v1 (deeplab-public)'),
    ('deeplab-public-ver2', 'segmentation', 'DeepLab v2'),
    ('SegNet', 'segmentation', "SegNet's Caffe"),
    ('TimoSaemann_ENet', 'segmentation', 'caffe-enet'),
    ('MobileNet-SSD', 'detection', 'SSD fork'),
    ('SSDLite', 'detection', "chuanqi305's SSD fork"),
    ('NVIDIA_caffe__models_VGGNet', 'detection', 'NVCaffe (SSD)'),
    ('detectnet', 'detection', 'NVCaffe (DetectNet)'),
    ('py-faster-rcnn', 'detection', 'caffe-fast-rcnn'),
    ('R-FCN', 'detection', "R-FCN's Caffe"),
    ('air101', 'detection', 'caffe-fast-rcnn (soeaver)'),
    ('Yolo', 'detection', 'YOLO ports'),
    ('yolo', 'detection', 'YOLO ports'),
    ('MobileNet-Caffe', 'classification', 'BVLC (+depthwise)'),
    ('ShuffleNet', 'classification', 'ShuffleNet fork'),
    ('SqueezeNet', 'classification', 'BVLC'),
    ('soeaver', 'classification', 'BVLC / PyTorch converter'),
    ('hujie-frank_SENet', 'classification', 'SENet (BVLC layers)'),
    ('bvlc_googlenet', 'classification', 'BVLC'),
    ('openpose', 'pose', 'OpenPose (BVLC)'),
    ('pose-machines', 'pose', 'CPM (BVLC)'),
    ('sphereface', 'faces', 'caffe-sphereface'),
    ('MTCNN_face', 'faces', 'BVLC (V1 format)'),
    ('VGG_FACE', 'faces', 'BVLC'),
    ('crnn', 'OCR', 'crnn.caffe (yalecyu)'),
    ('srcnn', 'super-resolution', 'BVLC'),
    ('vdsr', 'super-resolution', 'BVLC'),
    ('fsrcnn', 'super-resolution', 'BVLC'),
]

#: DeepLab's configs are templates that its run scripts fill with sed: its PASCAL VOC values
TEMPLATE_VALUES = {'NUM_LABELS': '21', 'EXP': 'voc12', 'NET_ID': 'resnet101',
                   'DATA_ROOT': 'voc12/data', 'TRAIN_SET': 'train_aug', 'TEST_SET': 'val',
                   'FEATURE_DIR': 'voc12/features', 'TEST_SET_POSTFIX': ''}


def kind_of(name):
    for part, domain, fork in KINDS:
        if part.lower() in name.lower():
            return domain, fork
    return '?', '?'


def one_net(path):
    """Runs in the subprocess: the result, as a dict for one JSON line."""
    sys.path[:0] = [str(ROOT), str(ROOT / 'tests')]
    import numpy as np
    import caffe_syncbn as caffe
    from caffe_syncbn import caffe_pb2
    from caffe_syncbn.errors import CaffeError
    from caffe_syncbn.netparam.inputs import swap_data_layers_for_inputs
    from caffe_syncbn.netparam.prototxt import parse_text
    from caffe_syncbn.netparam.upgrade import load_net_param
    from helpers.model_weights import BATCH_NORMS, calibrate, random_weights

    name = os.path.basename(path)
    notes = []
    try:
        text = open(path).read()
        if '${' in text:
            text = re.sub(r'\$\{(\w+)\}', lambda m: TEMPLATE_VALUES[m.group(1)], text)
            notes.append('template filled as its run script does')
            param = load_net_param(parse_text(text, caffe_pb2.NetParameter(), path))
        else:
            param = load_net_param(path)
        for layer in param.layer:       # the lists MatWrite reads, and where it writes
            if layer.type == 'MatWrite':
                p = layer.mat_write_param
                os.makedirs(os.path.dirname(p.source) or '.', exist_ok=True)
                with open(p.source, 'w') as f:
                    f.write('2007_000033\n2007_000042\n2007_000061\n')
                os.makedirs(p.prefix or '.', exist_ok=True)
        shapes = next((s for part, s in SHAPES.items() if part.lower() in name.lower()), None)
        if shapes is None:      # batch 1 at the net's own size
            probe = swap_data_layers_for_inputs(param, batch=1)
            shapes = {}
            for layer in probe.layer:
                if layer.type == 'Input':
                    for top, shape in zip(layer.top, layer.input_param.shape):
                        dims = list(shape.dim)
                        if dims and len(dims) == 4:
                            shapes[top] = tuple([1] + dims[1:])
        probe = swap_data_layers_for_inputs(param, batch=1)
        inputs = {t for layer in probe.layer if layer.type == 'Input' for t in layer.top}
        shapes = {k: v for k, v in shapes.items() if k in inputs}
        final = swap_data_layers_for_inputs(param, shapes=shapes, batch=1)
        net = caffe.Net(final, caffe.TEST)
        rng = np.random.default_rng(0)
        data_shape = None
        for top in net.inputs:
            blob = net.blobs[top]
            if top == 'im_info':
                blob.data[...] = 0
                blob.data[0, :3] = [data_shape[2], data_shape[3], 1.0]
            elif top == 'rois':
                h, w = data_shape[2:]
                boxes = np.zeros(blob.shape, np.float32).reshape(blob.shape[0], -1)
                boxes[:, 1:5] = [w * 0.1, h * 0.1, w * 0.8, h * 0.7]
                blob.data[...] = boxes.reshape(blob.shape)
            elif top in ('label', 'sem', 'geo'):
                blob.data[...] = 0
            else:
                blob.data[...] = rng.uniform(-1, 1, blob.shape)
                if data_shape is None and len(blob.shape) == 4:
                    data_shape = blob.shape
        weights = random_weights(net, rng)
        if any(layer.type in BATCH_NORMS for layer in net.layers):
            calibrate(net, weights, rng)
        start = time.time()
        outputs = net.forward()
        seconds = time.time() - start
        bad = [k for k, v in outputs.items() if not np.all(np.isfinite(v))]
        shapes_out = {k: list(np.shape(v)) for k, v in outputs.items()}
        if bad:
            return dict(result='DEFECT', line='outputs not finite: %s' % bad, notes=notes)
        return dict(result='OK', line='outputs %s; input %s; forward %.1f s' % (
            shapes_out, {k: list(net.blobs[k].shape) for k in net.inputs}, seconds),
            notes=notes)
    except CaffeError as e:
        line = str(e)
        return dict(result='ERROR' if '\n' not in line.strip() else 'DEFECT',
                    line=line.strip(), notes=notes)
    except Exception as e:      # a defect of ours: record the type and the last frames
        import traceback
        tb = traceback.format_exc().strip().splitlines()
        return dict(result='DEFECT', line='%s: %s' % (type(e).__name__, e),
                    traceback=tb[-8:], notes=notes)


def main(argv):
    label, folder, out_folder = None, NETS, ROOT / 'out' / 'real_prototxts'
    if argv[:1] == ['--out']:
        out_folder, argv = pathlib.Path(argv[1]), argv[2:]
    if argv[:1] == ['--label']:
        label, argv = argv[1], argv[2:]
    if label is None:
        label = subprocess.run(['git', 'rev-parse', '--abbrev-ref', 'HEAD'], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip() or 'tree'
    names = sorted(p.name for p in folder.glob('*.prototxt'))
    if argv:
        names = [n for n in names if any(a in n for a in argv)]
    rows = []
    for name in names:
        start = time.time()
        try:
            done = subprocess.run([sys.executable, __file__, '--one', str(folder / name)],
                                  capture_output=True, text=True, timeout=TIMEOUT_S,
                                  cwd=tempfile.mkdtemp(prefix='real_prototxt_'))
            last = [l for l in done.stdout.splitlines() if l.startswith('{')]
            if done.returncode == 0 and last:
                found = json.loads(last[-1])
            else:
                found = dict(result='DEFECT', line='exit %d; stderr tail: %s' % (
                    done.returncode, ' | '.join(done.stderr.strip().splitlines()[-3:])))
        except subprocess.TimeoutExpired:
            found = dict(result='TIMEOUT', line='no answer in %d s' % TIMEOUT_S)
        domain, fork = kind_of(name)
        found.update(name=name, domain=domain, fork=fork, wall=round(time.time() - start, 1))
        rows.append(found)
        print('%-7s %6.1fs %s | %s%s' % (found['result'], found['wall'], name, found['line'],
                                          ' [%s]' % '; '.join(found['notes'])
                                          if found.get('notes') else ''), flush=True)
        if found.get('traceback'):
            print('        ' + '\n        '.join(found['traceback']), flush=True)
    out = out_folder / ('results_%s.tsv' % label.replace('/', '_'))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, 'w') as f:
        f.write('name\tdomain\tfork\tresult\tline\n')
        for r in rows:
            f.write('\t'.join([r['name'], r['domain'], r['fork'], r['result'],
                               r['line'].replace('\t', ' ').replace('\n', ' | ')]) + '\n')
    count = sum(r['result'] == 'OK' for r in rows)
    print('%d of %d ran (%s)' % (count, len(rows), out))


if __name__ == '__main__':
    if sys.argv[1:2] == ['--one']:
        print(json.dumps(one_net(sys.argv[2])))
    else:
        main(sys.argv[1:])
