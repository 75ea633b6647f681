"""memory_plan='share': a forward-only net whose blobs share storage by liveness gives
bitwise the outputs of the same net with every blob kept, on every golden net and a
corpus net, with its shared arena filled with NaN bytes first (a layer that read a value
its top did not write, or bytes given to two live blobs, would show); and the arena's
layout, against the lives it packs."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import caffe_syncbn as caffe
from caffe_syncbn import memory_plan
from caffe_syncbn.analysis.timing import timing_net_param
from helpers.paths import GOLDEN, ROOT, require


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    monkeypatch.setattr(memory_plan, 'new_buffer',
                        lambda xp, nbytes: xp.full(nbytes, 0xFF, np.uint8))


def golden_nets():
    """The golden cases of BVLC Caffe and of the PSPNet fork that are nets or layers."""
    indexes = [GOLDEN / name for name in ('index.json', 'psp_index.json')]
    if not indexes[0].exists():
        return ['<no golden data>']
    return [case['name'] for index in indexes if index.exists()
            for case in json.loads(index.read_text())['cases']
            if case['kind'] in ('layer', 'net') and not case['name'].startswith(('data_', 'datum_'))
            and (GOLDEN / (case['name'] + '.prototxt')).exists()]


def weights_of(name):
    path = GOLDEN / (name + '.caffemodel')
    return str(path) if path.exists() else None


def twin_nets(model, weights=None, keep=()):
    kept = caffe.Net(model, caffe.TEST, weights=weights)
    planned = caffe.Net(model, caffe.TEST, weights=weights, memory_plan='share', keep=keep)
    rs = np.random.RandomState(0)
    for mine, theirs in zip(kept.layers, planned.layers):       # fillers draw in order
        for a, b in zip(mine.blobs, theirs.blobs):
            if weights is None:
                a.data[...] = random_param(rs, a.shape)
            b.data[...] = a.data
    return kept, planned


def random_param(rs, shape):
    """Weights that keep a deep net's activations near 1 (He's scale), and positive vectors,
    so that batch norms' variances are variances."""
    if len(shape) > 1:
        return rs.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[1:]))
    return rs.uniform(0.5, 1.5, shape)


def inputs_of(net, seed=1):
    rs = np.random.RandomState(seed)
    return {name: rs.uniform(0, 3, net.blobs[name].shape).astype(np.float32)
            for name in net.inputs}


def same_outputs(kept, planned, inputs):
    want, got = kept.forward(**inputs), planned.forward(**inputs)
    assert set(got) == set(want)
    for name in want:
        assert not np.isnan(want[name]).all(), name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize('name', golden_nets())
def test_every_golden_net_gives_the_same_outputs(name, monkeypatch):
    require(GOLDEN / (name + '.prototxt'))
    monkeypatch.chdir(GOLDEN)                 # the nets name their files relative to it
    try:
        kept, planned = twin_nets(str(GOLDEN / (name + '.prototxt')), weights_of(name))
    except caffe.CaffeError as exc:
        pytest.skip('no TEST net to build: %s' % exc)
    recorded = np.load(GOLDEN / (name + '.npz'))
    inputs = {k.split('/', 1)[1]: recorded[k] for k in recorded.files if k.startswith('input/')}
    same_outputs(kept, planned, inputs or inputs_of(kept))


def test_resnet50_shares_a_few_buffers_and_gives_the_same_outputs():
    param = timing_net_param(ROOT / 'examples' / 'resnet50' / 'ResNet-50-deploy.prototxt',
                             batch=1, force_backward=False)
    kept, planned = twin_nets(param)
    inputs = inputs_of(kept)
    same_outputs(kept, planned, inputs)
    all_blobs = sum(blob.data.nbytes for blob in kept.blobs.values())
    arena = planned.planner.plan.arena.nbytes
    assert most_bytes_live(planned.planner.plan.groups) <= arena <= 1.05 * most_bytes_live(
        planned.planner.plan.groups) and arena < all_blobs / 10
    # a new input shape plans again, and the outputs stay the same; back to the first
    # shape, the arena is as it was (each block sized for its blob, not for its old block)
    bigger = {name: np.concatenate([x, x[::-1]]) for name, x in inputs_of(kept, 2).items()}
    same_outputs(kept, planned, bigger)
    assert planned.planner.plan.holds() and planned.planner.plan.arena.nbytes > arena
    same_outputs(kept, planned, inputs)
    assert planned.planner.plan.arena.nbytes == arena


def most_bytes_live(groups):
    """The most bytes that the groups' lives hold at one step: no layout does better."""
    steps = max(group.last for group in groups) + 1
    return max(sum(g.nbytes for g in groups if g.first <= step <= g.last)
               for step in range(steps))


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 10), st.integers(0, 5000)),
                min_size=1, max_size=40))
@settings(max_examples=200, deadline=None)
def test_the_arena_never_gives_bytes_to_two_groups_alive_at_once(lives):
    groups = [memory_plan._Group(caffe.Blob((size,), np.uint8), first, first + length)
              for first, length, size in lives]
    arena = memory_plan._place(groups)
    assert arena >= most_bytes_live(groups)
    for group in groups:
        assert group.offset % memory_plan.ALIGNMENT == 0
        assert group.offset + group.nbytes <= arena
        for other in groups:
            if other is not group and group.nbytes and other.nbytes and \
                    other.offset < group.offset + group.nbytes and \
                    group.offset < other.offset + other.nbytes:
                assert other.last < group.first or group.last < other.first


def test_kept_blobs_stay_and_the_others_say_how_to_keep_them():
    param = timing_net_param(ROOT / 'examples' / 'resnet50' / 'ResNet-50-deploy.prototxt',
                             batch=1, force_backward=False)
    kept, planned = twin_nets(param, keep=['res4a'])
    inputs = inputs_of(kept)
    got = planned.forward(blobs=['res4a'], **inputs)
    np.testing.assert_array_equal(got['res4a'], kept.forward(blobs=['res4a'], **inputs)['res4a'])
    with pytest.raises(caffe.CaffeError, match=r"^blob 'res3a' was not kept; pass "
                                                r"keep=\['res3a'\] or memory_plan='off'$"):
        planned.blobs['res3a']
    with pytest.raises(KeyError):
        planned.blobs['no such blob']
    assert 'res3a' not in planned.blobs and 'data' in planned.blobs and 'prob' in planned.blobs
    with pytest.raises(caffe.CaffeError, match="runs forward only"):
        planned.backward()
    with pytest.raises(caffe.CaffeError, match=r"keep: net 'ResNet-50' has no blob 'nope'"):
        caffe.Net(param, caffe.TEST, memory_plan='share', keep=['nope'])
    with pytest.raises(caffe.CaffeError, match=r"memory_plan 'all': expected one of off, share"):
        caffe.Net(param, caffe.TEST, memory_plan='all')


def test_a_top_never_takes_the_buffer_of_a_bottom_of_its_own_layer():
    """Liveness is by layer index: a blob last read by layer i frees its buffer only for
    the tops of later layers, so a layer never overwrites what it still reads."""
    text = '''name: "chain" layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
    layer { name: "a" type: "TanH" bottom: "x" top: "a" }
    layer { name: "b" type: "Sigmoid" bottom: "a" top: "b" }
    layer { name: "c" type: "Eltwise" bottom: "a" bottom: "b" top: "c" }
    layer { name: "d" type: "TanH" bottom: "c" top: "d" }
    layer { name: "e" type: "Sigmoid" bottom: "d" top: "e" }'''
    param = _text_param(text)
    kept, planned = twin_nets(param)
    plan = planned.planner.plan
    assert len({group.offset for group in plan.groups}) < len(plan.groups)   # d reuses a's
    for group in plan.groups:
        for other in plan.groups:
            if other is not group and other.offset == group.offset:
                assert other.last < group.first or group.last < other.first
    same_outputs(kept, planned, inputs_of(kept))


def _text_param(text):
    from caffe_syncbn import caffe_pb2
    from caffe_syncbn.netparam.prototxt import parse_text
    return parse_text(text, caffe_pb2.NetParameter())
