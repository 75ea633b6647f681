"""Fuzz: byte mutations of real files, fed to every reader in a child process.

Each test draws its mutants with fixed seeds from files of ../shared (BVLC Caffe's own
outputs) and runs them through tests/helpers/fuzz_harness.py: nothing but a CaffeError (one line,
naming the file), no signal, no hang, and no weights file cut short accepted in silence.
"""
import shutil

import h5py
import numpy as np
import pytest

from caffe_syncbn import caffe_pb2
from helpers.paths import GOLDEN, require
from helpers.fuzz_harness import (Tally, Worker, huge_length, mutants, short_folder,
                                  top_level_cuts)

pytestmark = pytest.mark.fuzz


@pytest.fixture(scope='module')
def worker():
    worker = Worker()
    yield worker
    worker.close()


@pytest.fixture
def tmp_path():
    with short_folder() as folder:
        yield folder


def write(path, data):
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(path)


# ---- weights ------------------------------------------------------------------------------
WEIGHT_CASES = ['format_hdf5_caffemodel', 'conv_basic', 'batchnorm_scale_bias', 'lstm',
                'prelu_channelwise', 'psp_bn_test', 'deconv_s2_p1_group2', 'embed']


def dropped_params(data, kept):
    """Whether the layers after the first ``kept`` top-level fields of a caffemodel hold
    blobs (a cut there loses weights)."""
    param = caffe_pb2.NetParameter.FromString(data)
    layers = list(param.layer) or list(param.layers)
    fields_before_layers = int(param.HasField('name'))
    return any(layer.blobs for layer in layers[max(kept - fields_before_layers, 0):])


def test_fuzz_binary_caffemodel(worker, tmp_path):
    tally = Tally('binary caffemodel')
    cases = [(c, GOLDEN / (c + '.prototxt'), GOLDEN / (c + '.caffemodel')) for c in WEIGHT_CASES]
    cases.append(('v1', GOLDEN / 'format_v1_caffemodel.prototxt',
                  GOLDEN / 'format_v1_caffemodel.v1.caffemodel'))
    for seed, (case, model, weights) in enumerate(cases):
        data = require(weights).read_bytes()
        for name, mutant in mutants(data, seed, 80, extra=[huge_length]):
            path = write(tmp_path / ('%s_%s.caffemodel' % (case, name)), mutant)
            answer = worker.run('net', {'model': str(model), 'weights': path})
            tally.add(path, answer, names=[path])
        for kept, mutant in top_level_cuts(data):
            path = write(tmp_path / ('%s_cut%d.caffemodel' % (case, kept)), mutant)
            answer = worker.run('net', {'model': str(model), 'weights': path})
            tally.add(path, answer, names=[path], must_report=dropped_params(data, kept))
    tally.check()


def h5_edits(source, folder):
    """Structured edits of a Caffe HDF5 weights file: (name, path, loses weights)."""
    with h5py.File(source, 'r') as f:
        layers = [name for name in f['data'] if len(f['data'][name])]
    edits = {
        'last_layer_gone': lambda f: f['data'].__delitem__(layers[-1]),
        'first_layer_gone': lambda f: f['data'].__delitem__(layers[0]),
        'text_blob': lambda f: _replace(f, layers[0], '0', np.array([b'abc'])),
        'int_blob': lambda f: _replace(f, layers[0], '0', np.arange(4)),
        'scalar_blob': lambda f: _replace(f, layers[0], '0', np.float32(1)),
        'wrong_shape': lambda f: _replace(f, layers[0], '0', np.zeros((2, 2), np.float32)),
        'gap': lambda f: f['data'][layers[0]].move('0', '7'),
        'data_is_a_dataset': lambda f: (f.__delitem__('data'), f.create_dataset('data', data=[1])),
        'no_data': lambda f: f.move('data', 'weights'),
        'huge_declared': lambda f: (f['data'][layers[0]].__delitem__('0'),
                                    f['data'][layers[0]].create_dataset(
                                        '0', shape=(2 ** 40,), dtype='f4', chunks=(1024,))),
        'compound': lambda f: _replace(f, layers[0], '0', np.zeros(3, 'f4,i4')),
        'nan': lambda f: f['data'][layers[0]]['0'].__setitem__((), np.nan),
        'nested_layer': lambda f: f['data'][layers[0]].create_group('inner').create_dataset(
            '0', data=np.zeros(3, np.float32)),
    }
    for name, edit in edits.items():
        path = folder / ('%s.caffemodel.h5' % name)
        shutil.copy(source, path)
        path.chmod(0o644)
        with h5py.File(path, 'r+') as f:
            edit(f)
        yield name, str(path), name.endswith('_gone')


def _replace(f, layer, index, value):
    del f['data'][layer][index]
    f['data'][layer].create_dataset(index, data=value)


def test_fuzz_hdf5_caffemodel(worker, tmp_path):
    tally = Tally('HDF5 caffemodel')
    for seed, case in enumerate(['format_hdf5_caffemodel', 'solver_snapshot_hdf5']):
        model = str(GOLDEN / (case + '.prototxt'))
        name = case + ('.caffemodel.h5' if case.startswith('format') else '_iter_6.caffemodel.h5')
        source = require(GOLDEN / name)
        for name, mutant in mutants(source.read_bytes(), 100 + seed, 250):
            path = write(tmp_path / ('%s_%s.caffemodel.h5' % (case, name)), mutant)
            tally.add(path, worker.run('net', {'model': model, 'weights': path}), names=[path])
        folder = tmp_path / case
        folder.mkdir()
        for name, path, loses in h5_edits(source, folder):
            answer = worker.run('net', {'model': model, 'weights': path})
            tally.add(path, answer, names=[path], must_report=loses)
    tally.check()


# ---- solver states ------------------------------------------------------------------------
def solver_folder(folder, case):
    """A copy of a golden solver case (solver, net, snapshot) that can be written in."""
    folder.mkdir()
    for path in GOLDEN.glob(case + '*'):
        shutil.copy(require(path), folder / path.name)
    return folder


def state_edits(data):
    """Structured edits of a binary SolverState: (name, bytes)."""
    state = caffe_pb2.SolverState.FromString(data)

    def edited(**fields):
        copy = caffe_pb2.SolverState()
        copy.CopyFrom(state)
        for key, value in fields.items():
            setattr(copy, key, value)
        return copy.SerializeToString()
    yield 'current_step_min', edited(current_step=-2 ** 31)
    yield 'current_step_past', edited(current_step=99)
    yield 'iter_negative', edited(iter=-5)
    yield 'iter_huge', edited(iter=2 ** 31 - 1)
    yield 'learned_net_missing', edited(learned_net='nowhere.caffemodel')
    yield 'learned_net_other', edited(learned_net='other_net.caffemodel')
    yield 'learned_net_empty', edited(learned_net='')
    yield 'learned_net_is_state', edited(learned_net=state.learned_net.replace('caffemodel',
                                                                               'solverstate'))
    shorter = caffe_pb2.SolverState()
    shorter.CopyFrom(state)
    del shorter.history[-1]
    yield 'history_short', shorter.SerializeToString()


def test_fuzz_solverstate(worker, tmp_path):
    require(GOLDEN / 'solver_snapshot_binaryproto_iter_6.solverstate')
    tally = Tally('solverstate')
    folder = solver_folder(tmp_path / 'binary', 'solver_snapshot_binaryproto')
    other = caffe_pb2.NetParameter.FromString(
        (folder / 'solver_snapshot_binaryproto_iter_6.caffemodel').read_bytes())
    for layer in other.layer:
        layer.name += '_other'
    (folder / 'other_net.caffemodel').write_bytes(other.SerializeToString())
    solver = str(folder / 'solver_snapshot_binaryproto.solver.prototxt')
    data = (folder / 'solver_snapshot_binaryproto_iter_6.solverstate').read_bytes()
    cases = list(mutants(data, 200, 300, extra=[huge_length])) + list(state_edits(data))
    for name, mutant in cases:
        path = write(folder / ('%s.solverstate' % name), mutant)
        answer = worker.run('solver', {'solver': solver, 'state': path}, cwd=folder)
        tally.add(path, answer, names=[path])
    folder = solver_folder(tmp_path / 'hdf5', 'solver_snapshot_hdf5')
    solver = str(folder / 'solver_snapshot_hdf5.solver.prototxt')
    data = (folder / 'solver_snapshot_hdf5_iter_6.solverstate.h5').read_bytes()
    for name, mutant in mutants(data, 201, 250):
        path = write(folder / ('%s.solverstate.h5' % name), mutant)
        answer = worker.run('solver', {'solver': solver, 'state': path}, cwd=folder)
        tally.add(path, answer, names=[path])
    tally.check()


# ---- mean files ---------------------------------------------------------------------------
def test_fuzz_binaryproto(worker, tmp_path):
    from caffe_syncbn.data.imageset import write_mean_file
    tally = Tally('binaryproto')
    write_mean_file(tmp_path / 'mean.binaryproto',
                    np.random.RandomState(0).rand(3, 4, 5).astype(np.float32))
    sources = [require(GOLDEN / 'infogain_source.infogain.binaryproto'),
               tmp_path / 'mean.binaryproto']
    for seed, source in enumerate(sources):
        for name, mutant in mutants(source.read_bytes(), 300 + seed, 200, extra=[huge_length]):
            path = write(tmp_path / ('%d_%s.binaryproto' % (seed, name)), mutant)
            tally.add(path, worker.run('mean_file', {'path': path}), names=[path])
    tally.check()


# ---- LMDB and Datum -----------------------------------------------------------------------
DATA_NET = '''layer { name: "data" type: "Data" top: "data" top: "label"
  data_param { source: "%s" batch_size: %d backend: LMDB } }
'''


def big_lmdb(folder):
    """An LMDB of 60 records of 3x40x40 (4800 bytes: each on overflow pages) and its
    branch pages, as a real data set has them."""
    from caffe_syncbn.data.datum import array_to_datum, write_lmdb
    rs = np.random.RandomState(5)
    records = [(b'%08d' % i, array_to_datum(rs.randint(0, 256, (3, 40, 40)).astype(np.uint8),
                                            i % 7).SerializeToString()) for i in range(60)]
    write_lmdb(str(folder), [records])
    return folder / 'data.mdb'


def lmdb_edits(data):
    """Meta-page and page-level edits of an LMDB data file: (name, bytes)."""
    import struct
    page = struct.unpack_from('<I', data, 40)[0]

    def put(offset, fmt, value, raw=data):
        raw = bytearray(raw)
        struct.pack_into(fmt, raw, offset, value)
        return bytes(raw)
    for meta in (0, page):
        yield 'm%d_magic' % meta, put(meta + 16, '<I', 0x12345678)
        yield 'm%d_version' % meta, put(meta + 20, '<I', 2)
        yield 'm%d_mapsize_huge' % meta, put(meta + 32, '<Q', 2 ** 62)
        yield 'm%d_mapsize_tiny' % meta, put(meta + 32, '<Q', 4096)
        yield 'm%d_root_far' % meta, put(meta + 128, '<Q', 2 ** 40)
        yield 'm%d_root_meta' % meta, put(meta + 128, '<Q', 1)
        yield 'm%d_last_page_huge' % meta, put(meta + 136, '<Q', 2 ** 40)
        yield 'm%d_txn_huge' % meta, put(meta + 144, '<Q', 2 ** 63)
    yield 'page_size_small', put(40, '<I', 512)
    yield 'page_size_odd', put(40, '<I', 3000)
    for cut in sorted({page, 2 * page, 2 * page + 100, len(data) - page, len(data) - 1}):
        yield 'cut_%d' % cut, data[:cut]
    for number in range(2, len(data) // page):         # every page past the metas zeroed
        yield 'page%d_zero' % number, data[:number * page] + bytes(page) + \
            data[(number + 1) * page:]


def test_fuzz_lmdb(worker, tmp_path):
    tally = Tally('LMDB')
    sources = [(require(GOLDEN / 'datum_lmdb' / 'data.mdb'), 4, 3),
               (big_lmdb(tmp_path / 'big'), 16, 5)]
    for seed, (source, batch, forwards) in enumerate(sources):
        data = source.read_bytes()
        cases = list(mutants(data, 400 + seed, 200)) + list(lmdb_edits(data))
        for name, mutant in cases:
            folder = tmp_path / ('%d_%s' % (seed, name))
            folder.mkdir()
            write(folder / 'data.mdb', mutant)
            model = write(folder / 'net.prototxt', DATA_NET % (folder, batch))
            tally.add(str(folder), worker.run('net', {'model': model, 'forwards': forwards}),
                      names=[str(folder)])
            tally.add(str(folder), worker.run('image_mean', {'path': str(folder)}),
                      names=[str(folder)])
    tally.check()


MIXED_NET = '''layer { name: "data" type: "Data" top: "data" top: "label"
  data_param { source: "%s" batch_size: 3 backend: LMDB } %s }
'''


def mixed_records(rs, count, shapes, encoded=False):
    """Datum records of the given shapes, drawn at random from record 1 on (record 0 has
    the first shape): a database whose channels or size change part of the way in."""
    import cv2
    from caffe_syncbn.data.datum import array_to_datum, encoded_datum
    records = []
    for i in range(count):
        shape = shapes[0] if i == 0 else shapes[rs.randint(len(shapes))]
        image = rs.randint(0, 256, shape).astype(np.uint8)
        if encoded:
            datum = encoded_datum(cv2.imencode('.png', image.transpose(1, 2, 0))[1].tobytes())
        else:
            datum = array_to_datum(image, i % 3)
        records.append((b'%08d' % i, datum.SerializeToString()))
    return records


MIXED_SHAPES = [[(3, 5, 5), (2, 5, 5)], [(3, 5, 5), (1, 5, 5)], [(3, 5, 5), (3, 6, 5)],
                [(1, 4, 4), (3, 4, 4)], [(3, 8, 8), (3, 5, 7)], [(3, 5, 5), (3, 5, 5), (4, 5, 5)]]


def test_fuzz_lmdb_of_mixed_shapes(worker, tmp_path):
    """Databases whose Datum records change channels or size part of the way in: a net
    with and without crop_size, forwarded past the change, and compute_image_mean."""
    from caffe_syncbn.data.datum import write_lmdb
    tally = Tally('LMDB of mixed shapes')
    rs = np.random.RandomState(8)
    for number, shapes in enumerate(MIXED_SHAPES):
        for encoded in (False, True):
            if encoded and any(shape[0] not in (1, 3) for shape in shapes):
                continue                  # PNG holds gray or colour
            folder = tmp_path / ('%d_%d' % (number, encoded))
            write_lmdb(str(folder), [mixed_records(rs, 12, shapes, encoded)])
            for transform in ('', 'transform_param { crop_size: 3 }'):
                model = write(folder / 'net.prototxt', MIXED_NET % (folder, transform))
                tally.add(str(folder), worker.run('net', {'model': model, 'forwards': 4}),
                          names=[str(folder)])
            tally.add(str(folder), worker.run('image_mean', {'path': str(folder)}),
                      names=[str(folder)])
    tally.check()


def datum_edits():
    """Datum records, good and bad: (name, serialized bytes)."""
    import cv2
    rs = np.random.RandomState(6)
    image = rs.randint(0, 256, (5, 6, 3)).astype(np.uint8)
    raw = caffe_pb2.Datum(channels=3, height=5, width=6, data=image.transpose(2, 0, 1).tobytes())
    yield 'raw', raw
    yield 'float', caffe_pb2.Datum(channels=1, height=2, width=3, float_data=[1, 2, 3, 4, 5, 6])
    for kind in ('.png', '.jpg'):
        yield 'encoded' + kind, caffe_pb2.Datum(data=cv2.imencode(kind, image)[1].tobytes(),
                                                encoded=True)
    yield 'encoded_empty', caffe_pb2.Datum(encoded=True)
    yield 'encoded_garbage', caffe_pb2.Datum(data=b'\x89PNG\r\n\x1a\n' + bytes(50), encoded=True)
    yield 'negative_channels', caffe_pb2.Datum(channels=-1, height=-1, width=90,
                                               data=image.tobytes())
    yield 'zero_size', caffe_pb2.Datum(channels=0, height=5, width=6)
    yield 'short_data', caffe_pb2.Datum(channels=3, height=5, width=6, data=b'12')
    yield 'huge_size', caffe_pb2.Datum(channels=2 ** 31 - 1, height=2 ** 31 - 1, width=7)


def test_fuzz_datum(worker, tmp_path):
    tally = Tally('Datum')
    for seed, (name, datum) in enumerate(datum_edits()):
        data = datum.SerializeToString()
        cases = [(name, data)] + list(mutants(data, 500 + seed, 60, extra=[huge_length]))
        for mutant_name, mutant in cases:
            path = write(tmp_path / ('%s_%s.datum' % (name, mutant_name)), mutant)
            tally.add(path, worker.run('datum', {'path': path}), names=[path])
    tally.check()


# ---- image lists, segmentation lists, HDF5 data ---------------------------------------------
IMAGE_NET = '''layer { name: "data" type: "ImageData" top: "data" top: "label"
  image_data_param { source: "%s" root_folder: "%s/" batch_size: 3 }
  transform_param { crop_size: 4 } }
'''
SEG_NET = '''layer { name: "data" type: "SegData" top: "data" top: "label"
  seg_data_param { source: "%s" root_dir: "%s/" } transform_param { crop_size: 4 } }
'''
HDF5_NET = '''layer { name: "data" type: "HDF5Data" top: "data" top: "label"
  hdf5_data_param { source: "%s" batch_size: 3 } }
'''


def list_edits(data, rs):
    """A line doubled, dropped or emptied, a label made odd, or a non-UTF-8 byte."""
    lines = data.split(b'\n')
    k = rs.randint(len(lines))
    kind = rs.randint(5)
    if kind == 0:
        lines[k] = lines[k].rsplit(b' ', 1)[0] + b' ' + [b'-1', b'x', b'99999999999999999999',
                                                         b''][rs.randint(4)]
    elif kind == 1:
        lines.insert(k, lines[k])
    elif kind == 2:
        lines[k] = b''
    elif kind == 3:
        lines[k] = b'caf\xe9_' + lines[k]
    else:
        lines[k] = b'nowhere.png ' + lines[k]
    return b'\n'.join(lines)


def image_folder(folder):
    """Images of two sizes (PNG and JPEG) and their label maps, with list files."""
    import cv2
    rs = np.random.RandomState(7)
    folder.mkdir()
    images, pairs = [], []
    for i in range(4):
        kind = '.png' if i % 2 else '.jpg'
        shape = (6 + i, 7, 3)
        image = rs.randint(0, 256, shape).astype(np.uint8)
        cv2.imwrite(str(folder / ('img%d%s' % (i, kind))), image)
        cv2.imwrite(str(folder / ('lab%d.png' % i)), rs.randint(0, 4, shape[:2]).astype(np.uint8))
        images.append('img%d%s %d' % (i, kind, i))
        pairs.append('img%d%s lab%d.png' % (i, kind, i))
    (folder / 'images.txt').write_text('\n'.join(images) + '\n')
    (folder / 'pairs.txt').write_text('\n'.join(pairs) + '\n')
    return folder


def test_fuzz_image_and_segmentation_lists(worker, tmp_path):
    tally = Tally('image and segmentation lists')
    for seed, (name, net) in enumerate([('images.txt', IMAGE_NET), ('pairs.txt', SEG_NET)]):
        source = image_folder(tmp_path / ('set%d' % seed))
        data = (source / name).read_bytes()
        for mutant_name, mutant in mutants(data, 900 + seed, 100, extra=[list_edits] * 4):
            path = write(source / ('%s_%s' % (mutant_name, name)), mutant)
            model = write(source / 'net.prototxt', net % (path, source))
            answer = worker.run('net', {'model': model, 'forwards': 2, 'phase': 'TRAIN'})
            tally.add(path, answer, names=[path])
    folder = image_folder(tmp_path / 'images')
    model = write(folder / 'net.prototxt', IMAGE_NET % (folder / 'images.txt', folder))
    for i, image in enumerate(sorted(folder.glob('img*'))):
        data = image.read_bytes()
        for mutant_name, mutant in mutants(data, 950 + i, 40):
            write(image, mutant)
            answer = worker.run('net', {'model': model, 'forwards': 2})
            tally.add('%s %s' % (image, mutant_name), answer, names=[str(image)])
        write(image, data)
    tally.check()


def test_fuzz_hdf5_data(worker, tmp_path):
    tally = Tally('HDF5 data')
    parts = [require(GOLDEN / ('data_hdf5.part%d.h5' % i)) for i in range(2)]
    for k, part in enumerate(parts):
        for name, mutant in mutants(part.read_bytes(), 1000 + k, 120):
            folder = tmp_path / ('%d_%s' % (k, name))
            folder.mkdir()
            files = [str(folder / p.name) for p in parts]
            for p in parts:
                shutil.copy(p, folder / p.name)
            write(folder / parts[k].name, mutant)
            source = write(folder / 'list.txt', '\n'.join(files) + '\n')
            model = write(folder / 'net.prototxt', HDF5_NET % source)
            answer = worker.run('net', {'model': model, 'forwards': 4})
            tally.add(files[k], answer, names=[files[k]])
    folder = tmp_path / 'lists'
    folder.mkdir()
    data = ('\n'.join(str(p) for p in parts) + '\n').encode()
    for name, mutant in mutants(data, 1010, 80, extra=[list_edits] * 2):
        source = write(folder / ('%s.txt' % name), mutant)
        model = write(folder / 'net.prototxt', HDF5_NET % source)
        tally.add(source, worker.run('net', {'model': model, 'forwards': 4}), names=[source])
    tally.check()
