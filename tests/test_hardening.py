"""Regression tests for issue #20, round two: images and weights files that are small on
disk but huge in memory, a log file on a full disk, files that are not regular files,
Python layers that are not layers, zero-sized blobs, Datum records of mixed shapes, and
snapshots that a power loss could lose."""
import io
import os
import shutil
import stat
import struct
import sys
import zlib

import numpy as np
import pytest
from helpers import watchdog
from helpers.fuzz_harness import Worker, short_folder

import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.data.datum import array_to_datum, write_lmdb
from caffe_syncbn.data.image_size import image_size
from caffe_syncbn.formats import mapped
from caffe_syncbn.formats.atomic import atomic_write
from caffe_syncbn.formats.caffemodel import read_weights

from helpers.messages import error_of, one_line
from helpers.paths import GOLDEN, ROOT, require


@pytest.fixture
def tmp_path():
    with short_folder() as folder:
        yield folder


def write(path, text):
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return str(path)


# ---- durability -----------------------------------------------------------------------------
def test_atomic_write_syncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    """The rename lives in the folder: the folder is synced once the file has its name."""
    target = tmp_path / 'run_iter_1.caffemodel'
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append((stat.S_ISDIR(os.fstat(fd).st_mode), target.exists()))
        real_fsync(fd)
    monkeypatch.setattr(os, 'fsync', recording_fsync)
    with atomic_write(target) as f:
        f.write(b'weights')
    assert synced == [(False, False), (True, True)]
    assert target.read_bytes() == b'weights'


# ---- Python layers --------------------------------------------------------------------------
@pytest.mark.parametrize('module, layer, kind', [('os', 'system', 'a function'),
                                                 ('collections', 'OrderedDict', 'a class'),
                                                 ('os', 'sep', 'a str')])
def test_python_layer_that_is_not_a_layer_is_one_line(tmp_path, module, layer, kind):
    path = write(tmp_path / 'net.prototxt', 'layer { name: "py" type: "Python" top: "a" '
                 'python_param { module: "%s" layer: "%s" } }' % (module, layer))
    one_line(error_of(caffe.Net, path, caffe.TEST), path, "layer 'py'",
             '%s.%s is %s, not a subclass of caffe.Layer' % (module, layer, kind))


# ---- the log file on a full disk ------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists('/dev/full'), reason='needs /dev/full')
def test_log_file_on_a_full_disk_is_one_warning_and_the_log_goes_on(tmp_path):
    """/dev/full fails every write with ENOSPC, as a full disk does."""
    script = ('import logging; from caffe_syncbn.glog import setup_logging\n'
              'setup_logging("/dev/full")\n'
              'for i in range(200): logging.getLogger("caffe_syncbn").info("line %d", i)\n')
    done = watchdog.run([sys.executable, '-c', script], capture_output=True, text=True,
                        limit=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert 'Logging error' not in done.stderr and 'Traceback' not in done.stderr, done.stderr
    warnings = [line for line in lines if line.startswith('W')]
    assert len(warnings) == 1, done.stderr
    one_line(warnings[0], 'cannot write the log file /dev/full: No space left on device',
             'the log goes on on stderr only')
    assert len(lines) == 201 and lines[-1].endswith('] line 199'), done.stderr


# ---- files that are not regular files -------------------------------------------------------
NET = '''layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 } }
'''
LISTS = {'ImageData': 'image_data_param { source: "%s" batch_size: 1 }',
         'SegData': 'seg_data_param { source: "%s" }',
         'HDF5Data': 'hdf5_data_param { source: "%s" batch_size: 1 }'}


def data_net(folder, kind, source):
    top = 'top: "data" top: "label"'
    return write(folder / ('%s.prototxt' % kind), 'layer { name: "d" type: "%s" %s %s }'
                 % (kind, top, LISTS[kind] % source))


@pytest.fixture(scope='module')
def quick_worker():
    """A reader stuck on a FIFO is a hang the worker reports after 10 s without progress,
    not a stuck suite."""
    worker = Worker(stall=10)
    yield worker
    worker.close()


def fifo_cases(folder):
    """(name, reader, args, the path the error must name) for every reader, on a FIFO."""
    fifo = folder / 'fifo'
    os.mkfifo(fifo)
    for name in ('fifo.caffemodel.h5', 'fifo.solverstate.h5'):
        os.mkfifo(folder / name)
    (folder / 'lmdb').mkdir()
    os.mkfifo(folder / 'lmdb' / 'data.mdb')
    net = write(folder / 'net.prototxt', NET)
    listing = write(folder / 'images.txt', '%s 0\n' % fifo)
    pairs = write(folder / 'pairs.txt', '%s %s\n' % (fifo, fifo))
    h5_list = write(folder / 'h5.txt', '%s\n' % fifo)
    lmdb_net = write(folder / 'lmdb.prototxt', 'layer { name: "d" type: "Data" top: "data" '
                     'data_param { source: "%s" batch_size: 1 backend: LMDB } }'
                     % (folder / 'lmdb'))
    yield 'net prototxt', 'net', {'model': str(fifo)}, fifo
    yield 'solver prototxt', 'solver', {'solver': str(fifo)}, fifo
    yield 'binary weights', 'net', {'model': net, 'weights': str(fifo)}, fifo
    yield 'HDF5 weights', 'weights', {'path': str(fifo) + '.caffemodel.h5'}, fifo
    yield '/dev/stdin as weights', 'weights', {'path': '/dev/stdin'}, '/dev/stdin'
    yield 'binary solverstate', 'solver_state', {'path': str(fifo)}, fifo
    yield 'HDF5 solverstate', 'solver_state', {'path': str(fifo) + '.solverstate.h5'}, fifo
    yield 'binaryproto', 'mean_file', {'path': str(fifo)}, fifo
    yield 'LMDB', 'net', {'model': lmdb_net}, folder / 'lmdb' / 'data.mdb'
    yield 'LMDB mean', 'image_mean', {'path': str(folder / 'lmdb')}, folder / 'lmdb'
    for kind in LISTS:
        yield kind + ' list', 'net', {'model': data_net(folder, kind, fifo)}, fifo
    yield 'listed image', 'net', {'model': data_net(folder, 'ImageData', listing)}, fifo
    yield 'listed pair', 'net', {'model': data_net(folder, 'SegData', pairs)}, fifo
    yield 'listed HDF5 file', 'net', {'model': data_net(folder, 'HDF5Data', h5_list)}, fifo


def test_every_reader_refuses_a_fifo_in_one_line(quick_worker, tmp_path):
    """A FIFO (or /dev/stdin, a pipe here) is refused before it is opened: opening it
    would wait for a writer."""
    for name, reader, args, path in fifo_cases(tmp_path):
        answer = quick_worker.run(reader, args, cwd=tmp_path)
        assert answer['outcome'] == 'CaffeError', (name, answer)
        one_line(answer['message'], path, 'is not a regular file (a FIFO)')


def test_resuming_from_a_learned_net_that_is_a_fifo(quick_worker, tmp_path):
    require(GOLDEN / 'solver_snapshot_binaryproto.solver.prototxt')
    for path in GOLDEN.glob('solver_snapshot_binaryproto*'):
        shutil.copy(path, tmp_path)
    os.mkfifo(tmp_path / 'fifo.caffemodel')
    state = caffe_pb2.SolverState.FromString(
        (tmp_path / 'solver_snapshot_binaryproto_iter_6.solverstate').read_bytes())
    state.learned_net = 'fifo.caffemodel'
    write(tmp_path / 'fifo.solverstate', state.SerializeToString())
    answer = quick_worker.run('solver', {'solver': 'solver_snapshot_binaryproto.solver.prototxt',
                                         'state': 'fifo.solverstate', 'steps': 0}, cwd=tmp_path)
    assert answer['outcome'] == 'CaffeError', answer
    one_line(answer['message'], 'solver state fifo.solverstate',
             'fifo.caffemodel is not a regular file (a FIFO)')


def test_weights_flag_naming_a_fifo(tmp_path):
    os.mkfifo(tmp_path / 'fifo')
    net = write(tmp_path / 'net.prototxt', NET)
    done = watchdog.run([sys.executable, '-m', 'caffe_syncbn', 'test', '-model', net,
                         '-weights', str(tmp_path / 'fifo')], capture_output=True, text=True,
                        limit=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == 'error: -weights %s is not a regular file (a FIFO)' % (
        tmp_path / 'fifo'), done.stderr


# ---- weights files small on disk, huge in memory --------------------------------------------
EMPTY_LAYER = b'\xa2\x06\x00'          # field 100 (layer), length-delimited, 0 bytes


def test_a_file_of_empty_layer_records_is_refused_before_parsing(tmp_path, monkeypatch):
    """The issue's file: 3 bytes a layer on disk, some 600 once parsed. The count of
    records refuses it before the parser sees any."""
    path = write(tmp_path / 'empty.caffemodel', EMPTY_LAYER * 300000)

    def parse(*args):
        raise AssertionError('the records were parsed before they were counted')
    monkeypatch.setattr(mapped, '_layers', parse)
    one_line(error_of(read_weights, path), path, 'more than 200000 records',
             "200001 'layer' records", 'CAFFE_SYNCBN_MAX_RECORDS raises the bound')


def test_the_record_bound_can_be_set(monkeypatch):
    path = require(GOLDEN / 'net_lenet.caffemodel')
    monkeypatch.setenv('CAFFE_SYNCBN_MAX_RECORDS', '5')
    one_line(error_of(read_weights, path), path, 'more than 5 records')
    monkeypatch.setenv('CAFFE_SYNCBN_MAX_RECORDS', 'many')
    one_line(error_of(read_weights, path), 'CAFFE_SYNCBN_MAX_RECORDS=many is not a number')
    monkeypatch.delenv('CAFFE_SYNCBN_MAX_RECORDS')
    assert len(read_weights(path).blobs) > 5


@pytest.mark.slow
def test_running_out_of_memory_on_a_weights_file_says_so(tmp_path, monkeypatch):
    """Under a memory limit, with the record bound raised past it, the parser fails to
    allocate: that is no truncated or corrupt file."""
    path = write(tmp_path / 'empty.caffemodel', EMPTY_LAYER * 2000000)
    monkeypatch.setenv('CAFFE_SYNCBN_MAX_RECORDS', str(10 ** 8))
    worker = Worker(memory_limit=400 << 20)
    try:
        answer = worker.run('weights', {'path': path})
    finally:
        worker.close()
    assert answer['outcome'] == 'CaffeError', answer
    one_line(answer['message'], 'ran out of memory reading %s' % path)


# ---- images small on disk, huge in memory ---------------------------------------------------
def huge_png(width=25000, height=25000):
    """A real 1-bit PNG of width x height black pixels: 80 KB on disk, 1.9 GB decoded in
    colour."""
    def chunk(kind, data):
        return struct.pack('>I', len(data)) + kind + data + struct.pack(
            '>I', zlib.crc32(kind + data))
    row = b'\0' * (1 + (width + 7) // 8)
    compressor = zlib.compressobj(9)
    payload = b''.join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack('>IIBBBBB', width, height, 1, 0, 0, 0, 0)
    return (b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', header) + chunk(b'IDAT', payload)
            + chunk(b'IEND', b''))


@pytest.fixture(scope='module')
def limited_worker():
    """The issue's case ran out of memory inside OpenCV under a memory limit."""
    worker = Worker(memory_limit=1 << 30)
    yield worker
    worker.close()


def image_cases(folder):
    big = folder / 'big.png'
    big.write_bytes(huge_png())
    small = folder / 'small.png'
    small.write_bytes(huge_png(8, 8))
    images = write(folder / 'images.txt', '%s 0\n' % big)
    pairs = write(folder / 'pairs.txt', '%s %s\n' % (big, small))
    labels = write(folder / 'labels.txt', '%s %s\n' % (small, big))
    seg = '''layer { name: "d" type: "%s" top: "data" top: "label" %s { source: "%s" } }'''
    yield 'ImageData', 'net', {'model': data_net(folder, 'ImageData', images)}, big
    yield 'SegData', 'net', {'model': data_net(folder, 'SegData', pairs)}, big
    yield 'SegData label map', 'net', {'model': data_net(folder, 'SegData', labels)}, big
    yield 'ImageSegData', 'net', {'model': write(folder / 'image_seg.prototxt', seg % (
        'ImageSegData', 'image_data_param', pairs))}, big
    datum = caffe_pb2.Datum(data=big.read_bytes(), encoded=True)
    yield 'encoded Datum', 'datum', {'path': write(folder / 'big.datum',
                                                   datum.SerializeToString())}, 'big.datum'


def test_an_image_over_the_pixel_bound_is_refused_before_decoding(limited_worker, tmp_path):
    for name, reader, args, path in image_cases(tmp_path):
        answer = limited_worker.run(reader, args, cwd=tmp_path)
        assert answer['outcome'] == 'CaffeError', (name, answer)
        one_line(answer['message'], path, 'is 25000 x 25000 pixels, more than 134217728',
                 'OPENCV_IO_MAX_IMAGE_PIXELS raises the bound')


def test_the_pixel_bound_holds_for_formats_opencv_checks_itself(tmp_path, monkeypatch):
    """Sun raster has no header reader here: OpenCV checks the variable it shares."""
    cv2 = pytest.importorskip('cv2')
    image = tmp_path / 'a.ras'
    assert cv2.imwrite(str(image), np.zeros((37, 53, 3), np.uint8))
    model = data_net(tmp_path, 'ImageData', write(tmp_path / 'images.txt', '%s 0\n' % image))
    monkeypatch.setenv('OPENCV_IO_MAX_IMAGE_PIXELS', '1000')
    worker = Worker()
    try:
        answer = worker.run('net', {'model': model})
    finally:
        worker.close()
    assert answer['outcome'] == 'CaffeError', answer
    one_line(answer['message'], image, 'more than 1000 pixels',
             'OPENCV_IO_MAX_IMAGE_PIXELS raises the bound')


@pytest.mark.parametrize('extension', ['.png', '.jpg', '.bmp', '.tiff', '.webp', '.ppm', '.gif'])
def test_image_sizes_are_read_from_headers(extension):
    cv2 = pytest.importorskip('cv2')
    ok, payload = cv2.imencode(extension, np.zeros((37, 53, 3), np.uint8))
    assert ok
    assert image_size(io.BytesIO(payload.tobytes())) == (53, 37)


def test_opencv_running_out_of_memory_is_one_line(tmp_path, monkeypatch):
    """With the bound raised past the memory limit, OpenCV's failure is one line."""
    big = tmp_path / 'big.png'
    big.write_bytes(huge_png())
    model = data_net(tmp_path, 'ImageData', write(tmp_path / 'images.txt', '%s 0\n' % big))
    monkeypatch.setenv('OPENCV_IO_MAX_IMAGE_PIXELS', str(10 ** 9))
    worker = Worker(memory_limit=1 << 30)
    try:
        answer = worker.run('net', {'model': model})
    finally:
        worker.close()
    assert answer['outcome'] == 'CaffeError', answer
    one_line(answer['message'], "OpenCV could not read image file '%s': Failed to allocate" % big)


# ---- zero-sized blobs and Datum records of mixed shapes -------------------------------------
ZERO_NET = '''layer { name: "in" type: "Input" top: "a" input_param { shape { %s } } }
layer { name: "x" type: "%s" bottom: "a" top: "b" %s }
'''


def zero_net(folder, dims, kind, param=''):
    shape = ' '.join('dim: %d' % d for d in dims)
    return write(folder / 'zero.prototxt', ZERO_NET % (shape, kind, param))


@pytest.mark.parametrize('dims', [(2, 0, 4, 5), (2, 3, 0, 5), (2, 0)])
def test_inner_product_without_inputs_is_refused_at_setup(tmp_path, dims):
    path = zero_net(tmp_path, dims, 'InnerProduct', 'inner_product_param { num_output: 2 }')
    one_line(error_of(caffe.Net, path, caffe.TEST), path, "layer 'x' (type InnerProduct)",
             'no inputs per sample', str(dims))


@pytest.mark.parametrize('kind', ['BatchNorm', 'BN', 'SyncBN'])
def test_batch_norm_on_a_zero_sized_spatial_axis_runs_in_test(tmp_path, kind):
    """With stored statistics there is nothing to average: an empty blob in, one out."""
    net = caffe.Net(zero_net(tmp_path, (2, 3, 0, 5), kind), caffe.TEST)
    net.forward()
    assert net.blobs['b'].data.shape == (2, 3, 0, 5)


def test_datum_of_another_shape_names_the_database_the_key_and_both_shapes(tmp_path):
    db = tmp_path / 'db'
    records = [(b'%08d' % i, array_to_datum(np.zeros((3 if i < 2 else 2, 5, 5), np.uint8))
                .SerializeToString()) for i in range(4)]
    write_lmdb(str(db), [records])
    path = write(tmp_path / 'net.prototxt', 'layer { name: "data" type: "Data" top: "data" '
                 'data_param { source: "%s" batch_size: 3 backend: LMDB } }' % db)
    net = caffe.Net(path, caffe.TRAIN)
    one_line(error_of(net.forward), "layer 'data' (type Data)", "record '00000002' of %s" % db,
             'has shape [2, 5, 5], the first record [3, 5, 5]')


def test_a_datum_of_several_labels_is_one_line_not_its_last_label(tmp_path):
    """caffe_ocr's Datum repeats field 5 (label); parsed as Caffe's, it kept the last label
    alone. A Datum that gives its fields in another order, or once, reads as before."""
    from caffe_syncbn.data.datum import parse_datum
    one = caffe.io.array_to_datum(np.zeros((1, 2, 2), np.uint8), label=3).SerializeToString()
    assert parse_datum(one).label == 3
    several = one + bytes([0x28, 5, 0x28, 7])               # field 5, varint, twice more
    with pytest.raises(caffe.CaffeError) as info:
        parse_datum(several, "record '0001' of ocr_lmdb")
    assert str(info.value) == (
        "record '0001' of ocr_lmdb holds 3 labels (a fork's Datum whose label is repeated, as "
        "caffe_ocr's); a Caffe Datum holds one, and its data layers read one")
    reordered = bytes([0x28, 3]) + one.replace(bytes([0x28, 3]), b'')
    assert parse_datum(reordered).label == 3
