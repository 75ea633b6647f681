"""The host's thread pool (backend/cpu_threads.py): splits over threads that cover every index
once and pass errors on, nested splits, GEMMs split over threads and accumulated in place;
fillers that write in chunks; blobs that make their diff on first use. The layers' host
engines against their array engines: tests/layers."""
import threading
import tracemalloc

import numpy as np
import pytest

from caffe_syncbn.backend import cpu_threads
from caffe_syncbn.precision import activation_dtype
from helpers.arrays import randn


# ---------------------------------------------------------------- the thread pool

def test_split_covers_every_index_once(threads):
    for count, min_part in [(0, 1), (1, 1), (7, 1), (1000, 3), (5, 10)]:
        seen = np.zeros(count, int)
        lock = threading.Lock()

        def work(a, b):
            with lock:
                seen[a:b] += 1
        cpu_threads.split(count, work, min_part)
        assert (seen == 1).all()


def test_split_raises_the_error_of_a_part_after_every_part_ran(threads):
    ran = []

    def work(a, b):
        ran.append(a)
        if b == 10:                         # the last part, whichever thread runs it
            raise ValueError('part %d' % a)
    with pytest.raises(ValueError, match='part'):
        cpu_threads.split(10, work)
    assert len(ran) == threads


def test_nested_splits_finish(threads):
    total = np.zeros(64)

    def outer(a, b):
        cpu_threads.split(b - a, lambda c, d: total.__setitem__(slice(a + c, a + d),
                                                                total[a + c:a + d] + 1))
    cpu_threads.split(64, outer)
    assert (total == 1).all()


@pytest.mark.parametrize('m, k, n', [(1, 1, 1), (3, 5, 2), (64, 300, 200), (300, 40, 2000),
                                     (2000, 4, 300), (300, 1, 200), (5, 1, 3000)])
def test_matmul_and_accumulate(threads, monkeypatch, m, k, n):
    monkeypatch.setattr(cpu_threads, 'PARALLEL_GEMM_MIN_FLOPS', 1)
    monkeypatch.setattr(cpu_threads, 'ACCUMULATE_CHUNK_BYTES', 4096)
    a, b = randn(m, k), randn(k, n, seed=1)
    np.testing.assert_allclose(cpu_threads.matmul(a, b), a @ b, rtol=1e-12, atol=1e-12)
    out = randn(m, n, seed=2)
    expected = out + a @ b
    cpu_threads.matmul(a, b, out=out, accumulate=True)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    # transposed operands and a strided output, as the layers pass them
    wide = np.zeros((m, n + 3))
    cpu_threads.matmul(np.ascontiguousarray(a.T).T, np.ascontiguousarray(b.T).T,
                       out=wide[:, 1:n + 1], accumulate=True)
    np.testing.assert_allclose(wide[:, 1:n + 1], a @ b, rtol=1e-12, atol=1e-12)
    assert not wide[:, 0].any() and not wide[:, n + 1:].any()


@pytest.mark.parametrize('half', ['float16', 'bfloat16'])
@pytest.mark.parametrize('m, k, n', [(3, 700, 5), (4, 50, 900), (900, 50, 4), (1, 1, 7)],
                         ids=['inner longest', 'columns longest', 'rows longest', 'outer'])
def test_half_matmul_sums_in_float32_and_rounds_once(threads, monkeypatch, half, m, k, n):
    """Mixed precision's GEMMs: half operands, a half or float32 output. The products of
    every chunk add up in float32 (error within k float32 ulps of sum |a||b|), and the
    result is rounded once into the output (within one ulp of its type)."""
    monkeypatch.setattr(cpu_threads, 'ACCUMULATE_CHUNK_BYTES', 4096)
    monkeypatch.setattr(cpu_threads, 'PARALLEL_GEMM_MIN_FLOPS', 1)
    dtype = activation_dtype(half)
    a, b = randn(m, k).astype(dtype), randn(k, n, seed=1).astype(dtype)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact, magnitude = a64 @ b64, np.abs(a64) @ np.abs(b64)
    for out_dtype in (dtype, np.dtype(np.float32)):
        out = cpu_threads.matmul(a, b, out=np.empty((m, n), out_dtype))
        ulp = 2.0 ** -(np.finfo(out_dtype).nmant + 1) if out_dtype != dtype else \
            {'float16': 2.0 ** -11, 'bfloat16': 2.0 ** -8}[half]
        error = np.abs(out.astype(np.float64) - exact)
        assert (error <= ulp * np.abs(exact) + k * 2.0 ** -24 * magnitude).all(), out_dtype


def test_half_matmul_makes_no_float32_copy_of_a_large_operand():
    """A float16 operand of 8 MiB goes to the BLAS in float32 chunks of
    ACCUMULATE_CHUNK_BYTES (2 MiB) per thread, not as one float32 copy of 16 MiB:
    mixed precision's memory per image would otherwise be float32's at its peak."""
    a = randn(64, 1 << 16).astype(np.float16)
    b = randn(1 << 16, 16, seed=1).astype(np.float16)
    tracemalloc.start()
    try:
        cpu_threads.matmul(a, b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < a.size * 4 / 2, '%.1f MiB' % (peak / 2.0 ** 20)


@pytest.mark.parametrize('filler', [
    'type: "constant" value: 0.25', 'type: "uniform" min: -2 max: 3',
    'type: "gaussian" std: 0.5 mean: 1', 'type: "xavier" variance_norm: AVERAGE',
    'type: "msra"', 'type: "gaussian" std: 2 sparse: 3', 'type: "positive_unitball"'])
def test_fill_in_chunks_draws_what_one_draw_gives(filler, monkeypatch):
    """fill() writes float32 in chunks; the values are those of one float64 draw."""
    from google.protobuf import text_format

    from caffe_syncbn import caffe_pb2
    from caffe_syncbn.blob import Blob
    from caffe_syncbn.fillers import fill, filled_array, set_random_seed
    param = text_format.Parse(filler, caffe_pb2.FillerParameter())
    monkeypatch.setattr('caffe_syncbn.fillers.FILL_CHUNK', 7)
    set_random_seed(11)
    expected = filled_array(param, (5, 4, 3)).astype(np.float32)
    set_random_seed(11)
    blob = Blob((5, 4, 3), np.float32)
    fill(param, blob)
    np.testing.assert_array_equal(blob.data, expected)


def test_blob_diff_is_made_on_first_use():
    from caffe_syncbn.blob import Blob
    blob = Blob((2, 3))
    assert blob._diff is None
    blob.reshape(3, 2)
    assert blob._diff is None and blob.diff.shape == (3, 2) and not blob.diff.any()
    blob.diff[...] = 1
    blob.reshape(6)                      # same count: the values stay
    assert blob.diff.shape == (6,) and blob.diff.all()
    blob.reshape(4)
    assert blob.diff.shape == (4,) and not blob.diff.any()
