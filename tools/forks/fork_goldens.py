"""What the forks' golden scripts share (make_segnet_goldens.py, make_deeplab_goldens.py): the
nets' input lines, one net case or data layer case run through the fork's pycaffe and written
as npz, image and label files, and the fork's commit. Import it after the fork's ``caffe`` is
on the path."""
import contextlib
import os
import pathlib
import struct
import zlib

os.environ.setdefault('GLOG_minloglevel', '2')

import caffe  # noqa: E402  (the fork's pycaffe; glog's level is read when it loads)
import numpy as np  # noqa: E402

FORK_DIR = pathlib.Path(caffe.__file__).resolve().parents[2]


def fork_commit():
    """The commit the build script wrote beside the fork's source."""
    return (FORK_DIR / 'FORK_COMMIT').read_text().strip()


def inputs_text(shapes):
    """``input`` / ``input_shape`` lines: the forks' Caffe predates the Input layer."""
    return ''.join('input: "%s"\ninput_shape { %s }\n'
                   % (name, ' '.join('dim: %d' % d for d in shape))
                   for name, shape in shapes.items())


def run_net_case(out, name, text, phase, make_inputs, seed, param_values=None):
    """Write <name>.prototxt, .npz (the keys of ../shared/golden's README) and the fork's
    <name>.caffemodel (its layers' settings at the fork's field numbers, and the weights
    ``param_values(rs, index, shape)`` gives, when given). ``make_inputs`` is a
    list of functions of a RandomState that give the input dicts, one per forward, drawn
    first; the forwards before the last are recorded as
    forward<k>/input/ and forward<k>/data/ (for layers that keep state over forwards). The
    backward runs, from standard normal top diffs on every output but a loss, when the net
    forces it. Paths in the net are relative to ``out``."""
    rs = np.random.RandomState(seed)
    inputs = [make(rs) for make in make_inputs]
    (out / (name + '.prototxt')).write_text(text)
    with in_folder(out):
        net = caffe.Net(name + '.prototxt', getattr(caffe, phase))
        record = run_net(net, text, phase, inputs, rs, param_values)
        net.save(name + '.caffemodel')
        del net                 # a layer that writes files closes them before the folder changes
    np.savez_compressed(out / (name + '.npz'), **record)


@contextlib.contextmanager
def in_folder(folder):
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(cwd)


def run_net(net, text, phase, inputs, rs, param_values):
    record = {'phase': np.array(phase), 'fork_commit': np.array(fork_commit())}
    if param_values is not None:
        for layer, blobs in net.params.items():
            for i, blob in enumerate(blobs):
                blob.data[...] = param_values(rs, i, blob.data.shape)
                record['param/%s/%d' % (layer, i)] = blob.data.copy()
    for k, forward_inputs in enumerate(inputs):
        prefix = '' if k == len(inputs) - 1 else 'forward%d/' % k
        for blob_name, values in forward_inputs.items():
            net.blobs[blob_name].data[...] = values
            record[prefix + 'input/' + blob_name] = values
        net.forward()
        for blob_name, blob in net.blobs.items():
            record[prefix + 'data/' + blob_name] = blob.data.copy()
    if 'force_backward: true' in text:
        backward(net, rs, record)
    return record


def backward(net, rs, record):
    for layer, blobs in net.params.items():
        for blob in blobs:
            blob.diff[...] = 0
    for blob_name in net.outputs:
        if blob_name != 'loss':
            topdiff = rs.standard_normal(net.blobs[blob_name].data.shape).astype(np.float32)
            net.blobs[blob_name].diff[...] = topdiff
            record['topdiff/' + blob_name] = topdiff
    net.backward()
    for blob_name, blob in net.blobs.items():
        record['diff/' + blob_name] = blob.diff.copy()
    for layer, blobs in net.params.items():
        for i, blob in enumerate(blobs):
            record['param_diff/%s/%d' % (layer, i)] = blob.diff.copy()


def png(path, image):
    """An 8-bit PNG of an HxW (gray) or HxWx3 (RGB) uint8 array, without an imaging library."""
    height, width = image.shape[:2]
    color = 2 if image.ndim == 3 else 0
    rows = b''.join(b'\x00' + image[r].tobytes() for r in range(height))

    def chunk(kind, data):
        return (struct.pack('>I', len(data)) + kind + data
                + struct.pack('>I', zlib.crc32(kind + data)))
    header = struct.pack('>IIBBBBB', width, height, 8, color, 0, 0, 0)
    path.write_bytes(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', header)
                     + chunk(b'IDAT', zlib.compress(rows, 9)) + chunk(b'IEND', b''))


def write_pairs(folder, rs):
    """Three 7 x 9 RGB images and their label images (classes 0..4), and their list file
    pairs.txt."""
    folder.mkdir(exist_ok=True)
    lines = []
    for i in range(3):
        png(folder / ('image%d.png' % i), rs.randint(0, 256, (7, 9, 3)).astype(np.uint8))
        png(folder / ('label%d.png' % i), rs.randint(0, 5, (7, 9)).astype(np.uint8))
        lines.append('image%d.png label%d.png\n' % (i, i))
    (folder / 'pairs.txt').write_text(''.join(lines))


def run_data_case(out, name, text, tops, batches=2):
    """A data layer's net in TEST: ``tops`` of each of ``batches`` forwards, as
    batch<k>/<top> (with three pairs and batches of two, the second wraps round)."""
    (out / (name + '.prototxt')).write_text(text)
    with in_folder(out):        # the list and its root folder are relative to this folder
        net = caffe.Net(name + '.prototxt', caffe.TEST)
        record = {'phase': np.array('TEST'), 'fork_commit': np.array(fork_commit())}
        for batch in range(batches):
            net.forward()
            for blob_name in tops:
                record['batch%d/%s' % (batch, blob_name)] = net.blobs[blob_name].data.copy()
        del net                 # joins the prefetch thread before the folder changes back
    np.savez_compressed(out / (name + '.npz'), **record)
