"""SyncBN within groups of replicas (sync_bn_group_size), and batches whose statistics are
not finite.

Groups: 4 replicas on threads, each with a communicator of all 4 (the loss normalizer's and
the gradients') and one of its group (comm/groups.py). The reference is test_norm_syncbn's
independent float64 BN, run on each group's concatenated batch with that group's running
statistics: K = 1 is per-device batch norm (each replica alone), K = 4 is SyncBN over all.
"""
import numpy as np
import pytest
from test_norm_syncbn import C, Replica, initial_params, reference_step, run_ok

from caffe_syncbn.backend import Device
from caffe_syncbn.comm import SoloComm, ThreadComm
from caffe_syncbn.comm.groups import Groups, group_communicators
from caffe_syncbn.errors import CaffeError

REPLICAS = 4


def grouped_replicas(group_size, params, dtype=np.float64):
    comms = ThreadComm.create(REPLICAS)
    devices = [Device('cpu', r) for r in range(REPLICAS)]
    group_comms = group_communicators(devices, None, Groups([REPLICAS], group_size), 0)
    layers = [None] * REPLICAS

    def build(r):
        layers[r] = Replica(comms[r], params, dtype=dtype)
        layers[r].layer.ctx.group_comm = group_comms[r]
    run_ok(build, REPLICAS)
    return layers, group_comms


@pytest.mark.parametrize('dtype, tol', [(np.float64, 1e-10), (np.float32, 1e-5)])
@pytest.mark.parametrize('group_size, split', [(1, (3, 2, 4, 2)), (2, (3, 0, 6, 2)),
                                               (4, (3, 0, 6, 2))])
def test_each_group_equals_one_bn_over_its_replicas_batches(group_size, split, dtype, tol):
    rs = np.random.RandomState(11 + group_size)
    params = initial_params(rs)
    layers, _ = grouped_replicas(group_size, params, dtype)
    bounds = np.concatenate([[0], np.cumsum(split)])
    pieces = [slice(bounds[r], bounds[r + 1]) for r in range(REPLICAS)]
    groups = [list(range(g, g + group_size)) for g in range(0, REPLICAS, group_size)]
    running = [params[2:] for _ in groups]
    for step in range(3):
        x = (rs.standard_normal((sum(split), C, 4, 5)) * rs.uniform(0.5, 3, (1, C, 1, 1))
             + rs.uniform(-1, 1, (1, C, 1, 1))).astype(dtype)
        dy = rs.standard_normal(x.shape).astype(dtype)
        outputs = run_ok(lambda r: (layers[r].forward(x[pieces[r]]),
                                    layers[r].backward(REPLICAS * dy[pieces[r]])), REPLICAS)
        for g, members in enumerate(groups):
            rows = np.concatenate([np.arange(sum(split))[pieces[r]] for r in members])
            y_ref, dx_ref, dslope_ref, dbias_ref, mean, var = reference_step(
                x[rows].astype(np.float64), dy[rows].astype(np.float64), params[0], params[1],
                *running[g])
            running[g] = [mean, var]
            y = np.concatenate([outputs[r][0] for r in members])
            dx = np.concatenate([outputs[r][1][0] for r in members]) / REPLICAS
            dslope = sum(outputs[r][1][1] for r in members) / REPLICAS
            dbias = sum(outputs[r][1][2] for r in members) / REPLICAS
            for name, got, want in [('y', y, y_ref), ('dx', dx, dx_ref),
                                    ('dslope', dslope, dslope_ref), ('dbias', dbias, dbias_ref)]:
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol,
                                           err_msg='step %d group %d %s' % (step, g, name))
            for j, want in ((2, mean), (3, var)):
                stats = [layers[r].layer.blobs[j].data.reshape(-1) for r in members]
                assert all(np.array_equal(s, stats[0]) for s in stats), 'group members differ'
                np.testing.assert_allclose(stats[0], want, rtol=tol, atol=tol)
    if group_size < REPLICAS:        # the teeth: the groups' statistics do differ
        assert not np.allclose(layers[0].layer.blobs[2].data, layers[-1].layer.blobs[2].data)


def test_groups_of_one_are_solo_and_groups_of_two_exchange_within_themselves():
    devices = [Device('cpu', r) for r in range(REPLICAS)]
    solo = group_communicators(devices, None, Groups([REPLICAS], 1), 0)
    assert all(isinstance(c, SoloComm) for c in solo)
    pairs = group_communicators(devices, None, Groups([REPLICAS], 2), 0)
    assert [(c.rank, c.size) for c in pairs] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    sums = run_ok(lambda r: pairs[r].allreduce(np.array([10.0 ** r]), tag='t')[0], REPLICAS)
    assert sums == [11.0, 11.0, 1100.0, 1100.0]


@pytest.mark.parametrize('counts, size, words', [
    ([4], 3, 'it must divide the number of replicas, 4 (1 process); divisors: 1, 2, 4'),
    ([4], 8, 'it must divide the number of replicas, 4'),
    ([3, 3], 2, "group 1 (replicas 2-3) would take part of process 0's replicas (0-2)"),
    ([2, 4], 3, "group 0 (replicas 0-2) would take part of process 1's replicas (2-5)")])
def test_a_group_size_the_replicas_cannot_take_is_one_line(counts, size, words):
    with pytest.raises(CaffeError) as error:
        Groups(counts, size)
    assert words in str(error.value) and '\n' not in str(error.value)


def test_groups_of_whole_processes_and_within_processes_are_placed():
    within = Groups([2, 2], 2)
    assert [within.processes(g) for g in range(2)] == [[0], [1]]
    assert within.describe([0, 1]) == [
        'group 0: replicas 0-1 (process 0, no traffic between processes)',
        'group 1: replicas 2-3 (process 1, no traffic between processes)']
    across = Groups([2, 2, 2, 2], 4)
    assert [across.processes(g) for g in range(2)] == [[0, 1], [2, 3]]
    assert across.describe([0, 0, 1, 1]) == [
        'group 0: replicas 0-3 (processes 0-1, within node 0)',
        'group 1: replicas 4-7 (processes 2-3, within node 1)']
    assert across.crossing_nodes([0, 0, 1, 1]) == [] and across.crossing_nodes([0, 1, 1, 1]) == [0]


# ---- batches whose statistics are not finite ----------------------------------------------------
@pytest.mark.parametrize('group_size', [4, 2])
@pytest.mark.parametrize('poison', [np.nan, np.inf])
def test_a_non_finite_batch_on_one_replica_leaves_its_groups_running_statistics(group_size,
                                                                                 poison):
    """Replica 2 of 4 gets a NaN (or inf) at its second forward: every replica of its group
    keeps the running statistics it had, bitwise, and counts one skipped update; the other
    group (groups of 2) updates as usual."""
    rs = np.random.RandomState(3)
    params = initial_params(rs)
    layers, _ = grouped_replicas(group_size, params)
    x = rs.standard_normal((8, C, 4, 5))
    run_ok(lambda r: layers[r].forward(x[2 * r:2 * r + 2]), REPLICAS)
    before = [[b.data.copy() for b in layer.layer.blobs[2:]] for layer in layers]
    bad = x.copy()
    bad[4, 1, 2, 3] = poison                       # a value of replica 2's part
    run_ok(lambda r: layers[r].forward(bad[2 * r:2 * r + 2]), REPLICAS)
    poisoned = set(range(2, 2 + group_size)) if group_size == 2 else set(range(REPLICAS))
    for r, layer in enumerate(layers):
        after = [b.data for b in layer.layer.blobs[2:]]
        assert all(np.isfinite(a).all() for a in after)
        kept = all(np.array_equal(a, b) for a, b in zip(after, before[r]))
        assert kept == (r in poisoned), r
        assert layer.layer.skipped_statistics == (1 if r in poisoned else 0)
