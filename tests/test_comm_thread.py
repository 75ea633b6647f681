"""ThreadComm and CountingComm: results, determinism, ordering, mismatch, abort, timeout."""
import time

import numpy as np
import pytest
from helpers.counting_comm import CountingComm
from helpers.threads import run_threads

from caffe_syncbn.comm import CollectiveMismatch, CommAborted, ThreadComm
from caffe_syncbn.comm.rendezvous import PARALLEL_SUM_MIN_SIZE


def run_members(fn, comms):
    """fn(comm) on one thread per member; returns (results, errors) by rank (a member
    left waiting is a hang: threads.run_threads)."""
    return run_threads(lambda rank: fn(comms[rank]), len(comms))


def ok(fn, comms):
    results, errors = run_members(fn, comms)
    for e in errors:
        if e is not None:
            raise e
    return results


@pytest.mark.parametrize('size', [1, 2, 3, 4])
@pytest.mark.parametrize('count', [7, PARALLEL_SUM_MIN_SIZE + 13])
def test_allreduce_is_the_rank_order_sum_bitwise_on_every_member(size, count):
    rs = np.random.RandomState(size)
    inputs = [rs.standard_normal(count).astype(np.float32) * 10 ** rs.uniform(-3, 3, count)
              .astype(np.float32) for _ in range(size)]
    expected = inputs[0].copy()
    for a in inputs[1:]:
        expected += a
    results = ok(lambda c: c.allreduce(inputs[c.rank].copy(), tag='t'), ThreadComm.create(size))
    for r in results:
        assert r.dtype == np.float32 and np.array_equal(r, expected)


@pytest.mark.parametrize('count', [3, PARALLEL_SUM_MIN_SIZE + 13])
def test_sums_that_are_not_finite_come_back_without_a_numpy_warning(count, recwarn):
    """inf + -inf and float16 overflows (a loss scale's diffs) are NaN and inf in the
    result, for the solver to name; numpy's RuntimeWarning, outside the log, stays out."""
    inputs = [np.full(count, 6e4, np.float16), np.full(count, 6e4, np.float16)]
    inputs[0][0], inputs[1][0] = np.inf, -np.inf
    results = ok(lambda c: c.allreduce(inputs[c.rank].copy(), tag='t'), ThreadComm.create(2))
    for r in results:
        assert np.isnan(r[0]) and np.all(np.isinf(r[1:]))
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_allreduce_in_place_multidimensional():
    comms = ThreadComm.create(3)

    def fn(c):
        a = np.full((2, 3), c.rank + 1.0)
        out = c.allreduce(a)
        assert out is a
        return a
    for a in ok(fn, comms):
        assert np.array_equal(a, np.full((2, 3), 6.0))


@pytest.mark.parametrize('order', ['C', 'F'])
def test_a_large_allreduce_sums_arrays_of_either_memory_order(order):
    """The members' slices of the sum write through a flat view of the result: a result laid
    out as a Fortran-ordered input is would take them in a copy, and lose them."""
    rs = np.random.RandomState(3)
    shape = (PARALLEL_SUM_MIN_SIZE // 64 + 1, 64)
    inputs = [np.asarray(rs.standard_normal(shape), order=order) for _ in range(3)]
    expected = inputs[0] + inputs[1] + inputs[2]
    results = ok(lambda c: c.allreduce(inputs[c.rank].copy(order=order)), ThreadComm.create(3))
    for r in results:
        assert np.array_equal(r, expected)


@pytest.mark.parametrize('count', [5, PARALLEL_SUM_MIN_SIZE + 1])
def test_broadcast_barrier_scalar(count):
    comms = ThreadComm.create(4)

    def fn(c):
        a = np.full(count, float(c.rank))
        c.broadcast(a, root=2, tag='params')
        c.barrier(tag='end')
        return a, c.allreduce_scalar(c.rank + 0.5, tag='count')
    for a, total in ok(fn, comms):
        assert np.all(a == 2.0) and total == 8.0


def test_async_keeps_issue_order_and_overlaps():
    comms = ThreadComm.create(3)
    big = PARALLEL_SUM_MIN_SIZE * 4

    def fn(c):
        grads = np.full(big, c.rank + 1.0)
        handle = c.allreduce_async(grads, tag='gradients')
        small = c.allreduce(np.array([c.rank + 1.0]), tag='after')   # ordered after the async one
        second = c.allreduce_async(np.array([1.0]), tag='last')
        result = handle.wait()
        assert result is grads
        value = second.wait()[0]
        c.close()
        return grads[0], grads[-1], small[0], value
    for values in ok(fn, comms):
        assert values == (6.0, 6.0, 6.0, 3.0)


def test_mismatched_tags_raise_on_every_member_naming_both():
    comms = ThreadComm.create(2)
    _, errors = run_members(
        lambda c: c.allreduce(np.zeros(3), tag='bn_a' if c.rank == 0 else 'bn_b'), comms)
    for e in errors:
        assert isinstance(e, CollectiveMismatch)
        assert "'bn_a'" in str(e) and "'bn_b'" in str(e)
    with pytest.raises(CollectiveMismatch):      # a failed group stays failed
        comms[0].barrier()


def test_mismatched_shapes_and_ops_raise():
    comms = ThreadComm.create(2)
    _, errors = run_members(lambda c: c.allreduce(np.zeros(3 + c.rank), tag='x'), comms)
    assert all(isinstance(e, CollectiveMismatch) and 'shape (4,)' in str(e) for e in errors)
    comms = ThreadComm.create(2)
    _, errors = run_members(lambda c: c.barrier('x') if c.rank else c.allreduce(np.zeros(1), 'x'),
                            comms)
    assert all(isinstance(e, CollectiveMismatch) and 'barrier' in str(e) for e in errors)


def test_abort_wakes_waiting_members_promptly():
    """The members wait in an allreduce when replica 0 aborts; without the abort reaching
    them they would wait out the group's timeout (300 s), which the watchdog of
    run_members calls a hang long before."""
    comms = ThreadComm.create(3)
    cause = RuntimeError('replica 0 broke')

    def fn(c):
        if c.rank == 0:
            time.sleep(0.3)
            c.abort(cause)
            return None
        c.allreduce(np.zeros(4), tag='bn1')
    _, errors = run_members(fn, comms)
    for rank in (1, 2):
        assert isinstance(errors[rank], CommAborted)
        assert errors[rank].__cause__ is cause and 'replica 0 broke' in str(errors[rank])
    with pytest.raises(CommAborted):             # and every later collective too
        comms[1].allreduce(np.zeros(4))


def test_abort_reaches_pending_async_handles():
    comms = ThreadComm.create(2)
    handle = comms[1].allreduce_async(np.zeros(PARALLEL_SUM_MIN_SIZE), tag='gradients')
    time.sleep(0.1)
    comms[0].abort(ValueError('boom'))
    with pytest.raises(CommAborted, match='boom'):       # not the wait's own timeout
        handle.wait(timeout=5)
    comms[1].close()


def test_timeout_names_the_missing_member():
    comms = ThreadComm.create(3, timeout=0.3)
    _, errors = run_members(lambda c: c.barrier('step') if c.rank != 1 else None, comms)
    assert errors[1] is None
    for rank in (0, 2):
        assert isinstance(errors[rank], CommAborted) and '[1]' in str(errors[rank])


def test_group_of_one_needs_no_threads():
    (comm,) = ThreadComm.create(1)
    a = np.arange(4.0)
    assert comm.allreduce(a, tag='x') is a and np.array_equal(a, np.arange(4.0))
    assert comm.allreduce_scalar(2.5) == 2.5
    comm.barrier()
    assert comm.allreduce_async(a).wait() is a


def test_rejects_non_numpy_arrays():
    (comm,) = ThreadComm.create(1)
    with pytest.raises(TypeError, match='numpy'):
        comm.allreduce([1.0, 2.0])


def test_counting_comm_records_calls_by_tag():
    (inner,) = ThreadComm.create(1)
    comm = CountingComm(inner)
    comm.allreduce(np.zeros(2), tag='bn1')
    comm.allreduce(np.zeros(2), tag='bn1')
    comm.allreduce(np.zeros(2), tag='bn2')
    comm.allreduce_scalar(1.0, tag='loss normalizer')
    comm.allreduce_async(np.zeros(2), tag='gradients').wait()
    comm.barrier()
    assert comm.count('allreduce', tag='bn1') == 2
    assert comm.count('allreduce') == 3
    assert comm.count('allreduce_scalar') == 1 and comm.count('allreduce_async') == 1
    assert comm.counts()[('barrier', None)] == 1
    assert comm.size == 1 and comm.rank == 0
    comm.reset()
    assert comm.count('allreduce') == 0
