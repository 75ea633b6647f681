"""Fuzz: prototxts, generated from the schema (hypothesis) and mutated from real ones.

Every net is built (every layer's setup and reshape) in a child process with a memory
limit (tests/helpers/fuzz_harness.py); the only outcomes allowed are a net or a CaffeError of
one line that names the file.
"""
import math
import re

import numpy as np
import pytest
from google.protobuf import descriptor, text_format
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from caffe_syncbn import caffe_pb2
from caffe_syncbn.layer import layer_type_list
from helpers.paths import CORPUS, GOLDEN, require
from helpers.fuzz_harness import SEED, Tally, Worker, mutants, short_folder

pytestmark = pytest.mark.fuzz
FieldDescriptor = descriptor.FieldDescriptor


@pytest.fixture(scope='module')
def worker():
    worker = Worker(memory_limit=512 << 20)
    yield worker
    worker.close()


@pytest.fixture(scope='module')
def folder():
    with short_folder() as name:
        yield name


INPUT = 'layer { name: "in" type: "Input" top: "a" top: "b" top: "c"\n' \
        '  input_param { shape { dim: 2 dim: 3 dim: 4 dim: 5 } } }\n'


@pytest.mark.slow
def test_every_layer_type_with_any_number_of_blobs(worker, folder):
    """Each registered type, default parameters, 0 to 3 bottoms and 0 to 3 tops."""
    tally = Tally('layer types x blob counts')
    for kind in layer_type_list():
        for bottoms in range(4):
            for tops in range(4):
                text = INPUT + 'layer { name: "x" type: "%s" %s %s }\n' % (
                    kind, ' '.join('bottom: "%s"' % 'abc'[i] for i in range(bottoms)),
                    ' '.join('top: "t%d"' % i for i in range(tops)))
                path = folder / ('%s_%d_%d.prototxt' % (kind, bottoms, tops))
                path.write_text(text)
                answer = worker.run('net', {'model': str(path)}, cwd=folder)
                tally.add(str(path), answer, names=[str(path)])
    tally.check()


@pytest.mark.slow
def test_every_layer_type_with_a_zero_sized_axis(worker, folder):
    """Each registered type on 1 to 3 bottoms with an axis of size 0 (Caffe's blobs may
    have one), run forward and backward in TRAIN and forward in TEST: it works or is a
    CaffeError naming the layer (an empty batch is refused by the batch norms when they
    run, since only then is the whole batch of a data-parallel run known)."""
    tally = Tally('layer types x zero-sized axes')
    for kind in layer_type_list():
        for axis in range(4):
            shape = ' '.join('dim: %d' % (0 if i == axis else 2 + i) for i in range(4))
            for bottoms in range(1, 4):
                text = ('layer { name: "in" type: "Input" top: "a" top: "b" top: "c" '
                        'input_param { shape { %s } } }\n' % shape +
                        'layer { name: "x" type: "%s" %s top: "t" }\n'
                        % (kind, ' '.join('bottom: "%s"' % 'abc'[i] for i in range(bottoms))))
                path = folder / ('%s_zero%d_%d.prototxt' % (kind, axis, bottoms))
                path.write_text(text)
                for phase in ('TRAIN', 'TEST'):
                    answer = worker.run('net', {'model': str(path), 'phase': phase,
                                                'forwards': 1, 'backward': phase == 'TRAIN'},
                                        cwd=folder)
                    tally.add(str(path), answer, names=["layer 'x'"])
    tally.check()


# ---- nets generated from the schema ---------------------------------------------------------
SANE = {'int': [1, 2, 3], 'float': [0.1, 1.0, 2.0], 'string': ['a']}
ODD = {'int': [-2 ** 31, -1, 0, 2 ** 31 - 1], 'uint': [0, 2 ** 31 - 1, 2 ** 32 - 1],
       'float': [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-30, 1e30],
       'string': ['', 'ü', 'nowhere.txt', 'x' * 300]}
KINDS = {FieldDescriptor.TYPE_INT32: 'int', FieldDescriptor.TYPE_INT64: 'int',
         FieldDescriptor.TYPE_SINT32: 'int', FieldDescriptor.TYPE_UINT32: 'uint',
         FieldDescriptor.TYPE_UINT64: 'uint', FieldDescriptor.TYPE_FLOAT: 'float',
         FieldDescriptor.TYPE_DOUBLE: 'float', FieldDescriptor.TYPE_STRING: 'string'}
LAYER_TYPES = layer_type_list() + ['NoSuchType']


def field_value(draw, field):
    """A value for ``field``: mostly a plain one, one time in three an odd one."""
    if field.type == FieldDescriptor.TYPE_BOOL:
        return draw(st.booleans())
    if field.type == FieldDescriptor.TYPE_ENUM:
        return draw(st.sampled_from([v.number for v in field.enum_type.values]))
    kind = KINDS[field.type]
    if draw(st.integers(0, 2)) == 0:
        return draw(st.sampled_from(ODD[kind]))
    return draw(st.sampled_from(SANE['int' if kind == 'uint' else kind]))


def fill_message(draw, message, depth):
    """Set a few random fields of ``message`` (and of its sub-messages)."""
    fields = [f for f in message.DESCRIPTOR.fields if f.type != FieldDescriptor.TYPE_BYTES]
    for field in draw(st.lists(st.sampled_from(fields), max_size=4, unique=True)):
        repeated = field.is_repeated
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth <= 0 or field.message_type.name in ('LayerParameter', 'BlobProto'):
                continue
            target = getattr(message, field.name)
            fill_message(draw, target.add() if repeated else target, depth - 1)
            continue
        values = [field_value(draw, field) for _ in range(draw(st.integers(1, 3)))]
        if repeated:
            getattr(message, field.name).extend(values)
        else:
            setattr(message, field.name, values[0])


def own_param(kind):
    """The name of the parameter message a layer type reads ('InnerProduct' ->
    'inner_product_param'), or None."""
    name = re.sub(r'(?<=[a-z0-9])(?=[A-Z])', '_', kind).lower() + '_param'
    return name if name in caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name else None


PARAM_FIELDS = [f.name for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields
                if f.type == FieldDescriptor.TYPE_MESSAGE and f.name.endswith('_param')]
ODD_DIMS = [0, -1, 10 ** 11]


@st.composite
def nets(draw):
    """A NetParameter: an Input of a random (sometimes odd) shape, then random layers,
    each with bottoms (mostly blobs that exist), tops (sometimes in place) and random
    values in its own parameter message and sometimes in another one."""
    net = caffe_pb2.NetParameter(name='generated')
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=5))
    if draw(st.integers(0, 9)) == 0:
        shape[draw(st.integers(0, len(shape) - 1))] = draw(st.sampled_from(ODD_DIMS))
    net.layer.add(name='in', type='Input', top=['data']).input_param.shape.add(dim=shape)
    blobs = ['data']
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(LAYER_TYPES))
        layer = net.layer.add(name='l%d' % i, type=kind)
        count = draw(st.sampled_from([1, 1, 1, 2, 0, 3]))
        layer.bottom.extend(draw(st.lists(st.sampled_from(blobs), min_size=count,
                                          max_size=count)))
        if draw(st.integers(0, 19)) == 0:
            layer.bottom.append('nowhere')
        in_place = layer.bottom and draw(st.integers(0, 4)) == 0
        layer.top.extend([layer.bottom[0]] if in_place else
                         ['t%d_%d' % (i, j) for j in range(draw(st.sampled_from([1, 1, 2, 0])))])
        blobs.extend(t for t in layer.top if t not in blobs)
        fields = [own_param(kind)] if own_param(kind) else []
        if draw(st.integers(0, 3)) == 0:
            fields.append(draw(st.sampled_from(PARAM_FIELDS)))
        for field in fields:
            fill_message(draw, getattr(layer, field), depth=2)
        if draw(st.integers(0, 9)) == 0:
            fill_message(draw, layer.param.add(), depth=1)
        if draw(st.integers(0, 9)) == 0:
            layer.propagate_down.extend(draw(st.lists(st.booleans(), max_size=3)))
    return net


@pytest.fixture(scope='module')
def generated():
    tally = Tally('generated nets')
    yield tally
    print(tally.summary())


@pytest.mark.slow
@settings(max_examples=2500, derandomize=not SEED, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@seed(SEED)
@given(net=nets())
def test_generated_nets(worker, folder, generated, net):
    path = folder / 'generated.prototxt'
    path.write_text(text_format.MessageToString(net))
    answer = worker.run('net', {'model': str(path)}, cwd=folder)
    generated.add(text_format.MessageToString(net, as_one_line=True)[:600], answer,
                  names=[str(path)])
    assert not generated.failures, generated.failures.pop()


# ---- mutations of real prototxts ------------------------------------------------------------
NUMBER = re.compile(rb'(?<=: )-?[0-9][0-9.e+-]*')
ODD_NUMBERS = [b'-1', b'0', b'100000000000', b'-2147483648', b'4294967296', b'nan', b'-inf',
               b'1e400', b'9' * 400]


def token_edits(data, rs):
    """A number replaced by an odd one, a line doubled or dropped, a Latin-1 byte, or a
    2 MB token."""
    kind = rs.randint(6)
    lines = data.split(b'\n')
    k = rs.randint(len(lines))
    if kind == 0:
        numbers = list(NUMBER.finditer(data))
        if numbers:
            m = numbers[rs.randint(len(numbers))]
            return data[:m.start()] + ODD_NUMBERS[rs.randint(len(ODD_NUMBERS))] + data[m.end():]
    if kind == 1:
        return b'\n'.join(lines[:k] + [lines[k]] + lines[k:])
    if kind == 2:
        return b'\n'.join(lines[:k] + lines[k + 1:])
    if kind == 3:
        return b'\n'.join(lines[:k] + [lines[k] + b' # caf\xe9 \xff']  + lines[k + 1:])
    if kind == 4:
        at = rs.randint(len(data))
        return data[:at] + b'\xe9' + data[at:]
    return data[:rs.randint(len(data))] + b'x' * (2 << 20)


GOLDEN_NETS = ['conv_basic', 'format_hdf5_caffemodel', 'lstm', 'psp_ppm_train', 'spp_max',
               'net_lenet', 'resnet_basic_block', 'slice_axis1', 'reshape_infer']


@pytest.mark.slow
def test_mutated_prototxts(worker, folder):
    tally = Tally('mutated prototxts')
    sources = [(path, 'net_param') for path in sorted(CORPUS.glob('*.prototxt'))
               if 'solver' not in path.name]
    sources += [(GOLDEN / (name + '.prototxt'), 'net') for name in GOLDEN_NETS
                if (GOLDEN / (name + '.prototxt')).exists()]
    require(CORPUS)
    for seed, (source, reader) in enumerate(sources):
        data = source.read_bytes()
        for name, mutant in mutants(data, 600 + seed, 50, extra=[token_edits] * 4):
            path = folder / ('%d_%s.prototxt' % (seed, name))
            path.write_bytes(mutant)
            answer = worker.run(reader, {'model': str(path)}, cwd=GOLDEN)
            tally.add(str(path), answer, names=[str(path)])
    tally.check()


def test_mutated_solvers(worker, folder):
    """Golden solvers (their nets built, one iteration run) and the corpus's (read)."""
    tally = Tally('mutated solvers')
    sources = sorted(GOLDEN.glob('solver_*.solver.prototxt'))[:8]
    require(GOLDEN)
    for seed, source in enumerate(sources):
        data = source.read_bytes()
        net = source.name.replace('.solver.prototxt', '.prototxt')
        (folder / net).write_bytes((GOLDEN / net).read_bytes())
        for name, mutant in mutants(data, 700 + seed, 60, extra=[token_edits] * 4):
            path = folder / ('%d_%s.solver.prototxt' % (seed, name))
            path.write_bytes(mutant)
            answer = worker.run('solver', {'solver': str(path), 'steps': 2}, cwd=folder)
            tally.add(str(path), answer, names=[str(path)])
    tally.check()


@pytest.mark.parametrize('policy', ['step', 'exp', 'inv', 'multistep', 'poly', 'sigmoid'])
def test_lr_policies_at_odd_settings(worker, folder, policy):
    """Each policy with odd gamma, power, stepsize, stepvalue and max_iter, for 3 steps."""
    tally = Tally('lr_policy %s' % policy)
    net = folder / 'solver_sgd_fixed.prototxt'
    net.write_bytes(require(GOLDEN / net.name).read_bytes())
    rs = np.random.RandomState(800 + SEED)
    for case in range(50):
        fields = {'gamma': rs.choice([-1.0, 0.0, 0.5, 2.0, 1e30]),
                  'power': rs.choice([-1.0, 0.0, 0.75, 1e30]),
                  'stepsize': rs.choice([-1, 0, 1, 2 ** 31 - 1]),
                  'max_iter': rs.choice([0, 1, 3, 2 ** 31 - 1])}
        text = 'net: "%s" base_lr: 0.1 lr_policy: "%s" %s\n' % (
            net.name, policy, ' '.join('%s: %s' % (k, v.item()) for k, v in fields.items()))
        if policy == 'multistep':
            text += ''.join('stepvalue: %d\n' % v for v in rs.choice([-5, 0, 1, 2, 7], 3))
        path = folder / ('%s_%d.solver.prototxt' % (policy, case))
        path.write_text(text)
        answer = worker.run('solver', {'solver': str(path), 'steps': 3}, cwd=folder)
        tally.add(str(path), answer, names=[str(path)])
    tally.check()
