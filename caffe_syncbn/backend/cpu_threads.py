"""How the numpy path uses the CPU's cores: BLAS runs single-threaded, and large GEMMs and
elementwise passes are split over a few threads of our own.

numpy's bundled OpenBLAS keeps its worker threads spinning between calls and makes the
calling thread spin while it waits for them. On a machine that other processes also load,
a descheduled worker then stalls every GEMM for a time slice: 2-thread runs measured 1.4
to 6 times slower than 1-thread runs. Our threads wait on locks instead (a waiting thread
gives its core away), and a caller never waits for a part of its work that no thread has
started: it runs that part itself. So work is at worst as fast as on one core.

The number of threads is what the BLAS was configured with when first asked
(OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, else the cores), or CAFFE_SYNCBN_THREADS.
From then on numpy's BLAS is kept at one thread per call. Replicas that share the
machine's cores share its BLAS threads too (``share_blas``).

The pool's threads start when it is made (thread_start.py). OpenBLAS maps a buffer for
each thread that calls it at once, at the first call that needs it, and its C code ends
the process when the mapping is refused: under a memory limit, ``start`` has the BLAS
take its buffers before the nets take the room, or says in one line that it cannot.
"""
import contextvars
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import CaffeError
from .thread_start import mebibytes, room_left, start_workers

try:
    import threadpoolctl
except ImportError:          # no control: leave the BLAS as it is, work in one thread
    threadpoolctl = None

log = logging.getLogger('caffe_syncbn')

#: below this many multiply-adds a GEMM runs whole in the calling thread
PARALLEL_GEMM_MIN_FLOPS = 1 << 24
#: below this many elements an elementwise pass runs whole in the calling thread
PARALLEL_MIN_ELEMENTS = 1 << 18
#: elementwise passes go through their arrays this many bytes at a time, so that a layer's
#: several passes over one block find it in the cache
BLOCK_BYTES = 1 << 19
#: a GEMM that accumulates into its output computes it this many bytes at a time
ACCUMULATE_CHUNK_BYTES = 2 << 20
#: below this inner dimension an accumulating GEMM (a fully connected layer's weight
#: gradient at a small batch) is bound by the traffic of its output, not by arithmetic:
#: it goes by blocks of whole rows, each of ACCUMULATE_CACHED_BYTES, which stay in a
#: core's L2 cache until they are added (AlexNet's fc6 at batch 4: 41 ms against 17 ms
#: with 2 MiB column blocks)
MEMORY_BOUND_INNER = 16
ACCUMULATE_CACHED_BYTES = 1 << 19

#: OpenBLAS's BUFFER_SIZE on x86-64 and most targets: one buffer per thread calling it at once
OPENBLAS_BUFFER_BYTES = 32 << 20
#: the side of the warm-up's GEMMs: large enough to take OpenBLAS's buffer (128 takes it),
#: and long enough for the calls of several threads to overlap
WARM_UP_SIDE = 512

_state = {'threads': None, 'pool': None, 'blas': None, 'blas_single': False,
          'blas_ready': 0}
_lock = threading.Lock()
_running_part = threading.local()      # a thread running a part of a split splits no further
#: each thread's buffers by use, kept between calls: a fresh one of a megabyte or more is
#: mapped anew by malloc and faults in its pages on every call
_scratch = threading.local()
_zeros = {}


def _blas_controller():
    if threadpoolctl is None:
        return None
    found = threadpoolctl.ThreadpoolController().select(user_api='blas')
    return found.lib_controllers[0] if found.lib_controllers else None


def share_blas(replicas):
    """Give each of ``replicas`` replicas on this machine's cores its share of numpy's BLAS
    threads (else R replicas x all cores of BLAS threads fight over the same cores). Returns
    the limit, which ``restore_original_limits()`` lifts, or None when there is none."""
    if replicas < 2 or threadpoolctl is None:
        return None
    return threadpoolctl.threadpool_limits(limits=max(1, (os.cpu_count() or 1) // replicas),
                                           user_api='blas')


def threads():
    """How many threads the numpy path uses (1 means: everything in the calling thread)."""
    if _state['threads'] is None:
        with _lock:
            if _state['threads'] is None:
                blas = _blas_controller()
                wanted = os.environ.get('CAFFE_SYNCBN_THREADS')
                _start(max(1, int(wanted) if wanted else blas.num_threads) if blas else 1, blas)
                _reserve_blas()
    return _state['threads']


def set_threads(count):
    """Use ``count`` threads from now on (the pool of the previous count winds down)."""
    with _lock:
        old = _state['pool']
        _start(max(1, int(count)), _state['blas'] or _blas_controller())
        _reserve_blas()
    if old is not None:
        old.shutdown(wait=False)


def _start(count, blas):
    pool = ThreadPoolExecutor(count - 1, 'caffe_syncbn') if count > 1 else None
    if pool is not None:
        try:
            start_workers(pool, count - 1, 'the host thread pool (CAFFE_SYNCBN_THREADS=%d)'
                          % count)
        except CaffeError:
            pool.shutdown(wait=False)
            raise
    _state['blas'], _state['blas_single'] = blas, False
    _state['pool'], _state['threads'] = pool, count


def start(callers=()):
    """Start the pool (``threads()``) and, where the process has a memory limit, the BLAS's
    buffers for every thread that may call it at once: the pool's, and the caller's or,
    where given, the ``callers``': for each thread that calls ``split`` (a replica's), a
    function that runs a function in it and returns its Future (DevicePool.submit). A
    BLAS without room for them is one CaffeError, before the first iteration."""
    threads()
    with _lock:
        _reserve_blas(callers)


def _reserve_blas(callers=()):
    """``start``'s buffers (the pool's and the callers'), with the lock held."""
    _single_threaded_blas()
    runners = [_state['pool'].submit] * (_state['threads'] - 1) if _state['pool'] else []
    runners += list(callers)
    count = len(runners) + (0 if callers else 1)
    if count > _state['blas_ready'] and room_left() is not None:
        _warm_up(runners, count, not callers)
        _state['blas_ready'] = count


def _warm_up(runners, count, in_caller):
    """A GEMM in ``count`` threads at once (each of ``runners`` runs one, and the caller if
    ``in_caller``), so that the BLAS maps a buffer for each: it does at a first call that
    overlaps others. First each thread takes its allocator's arena (glibc maps 64 MiB for a
    thread's first malloc), then the room left is checked, then the GEMMs run."""
    square = np.ones((WARM_UP_SIDE, WARM_UP_SIDE), np.float32)
    # the caller passes both barriers: no GEMM runs before the room is checked
    ready, go = threading.Barrier(len(runners) + 1), threading.Barrier(len(runners) + 1)

    def gemm(first_malloc=True):
        try:
            if first_malloc:
                bytearray(1 << 12)                # above pymalloc's sizes: malloc's arena
                ready.wait()
            go.wait()
        except threading.BrokenBarrierError:   # the room is short: no GEMM
            return
        for _ in range(2):
            np.matmul(square, square)
    parts = [run(gemm) for run in runners]
    try:
        ready.wait()
        _check_room(count)
    except BaseException:
        go.abort()
        raise
    if in_caller:
        gemm(first_malloc=False)
    else:
        go.wait()
    for part in parts:
        part.result()


def _check_room(count):
    """One CaffeError where OpenBLAS would have no room for the buffers of ``count`` threads;
    else a line saying what the BLAS takes (its last, should OpenBLAS end the process)."""
    room = room_left()
    blas = _state['blas']
    name = 'OpenBLAS %s' % blas.version if getattr(blas, 'internal_api', None) == 'openblas' \
        else None
    # every buffer counted as still to map: a warm-up whose GEMMs did not overlap mapped
    # fewer than it asked for, and which of them exist no call tells
    need = count * OPENBLAS_BUFFER_BYTES
    if name and need > room[0]:
        raise CaffeError('%s asks for a buffer of %s in each of the %d threads that call it at '
                         'once, %s more; the process has %s: raise the limit, or use fewer '
                         'threads (CAFFE_SYNCBN_THREADS) or devices'
                         % (name, mebibytes(OPENBLAS_BUFFER_BYTES), count, mebibytes(need),
                            room[1]))
    log.info('Starting the BLAS (%s) in %d threads at once under a memory limit: %s',
             name or 'its buffers', count, room[1])


def _single_threaded_blas():
    """Set numpy's BLAS to one thread, once: asking it (a few microseconds) on every GEMM
    of a small net adds up."""
    if _state['blas_single']:
        return
    blas = _state['blas']
    if blas is not None and blas.get_num_threads() != 1:
        blas.set_num_threads(1)
    _state['blas_single'] = True


def split(count, work, min_part=1, parts=None):
    """Run ``work(start, stop)`` over [0, count) in ``parts`` (default threads()) parts of
    at least ``min_part``. The calling thread takes the first part, then, from the last
    backwards, every part that no thread has started (the pool takes them from the
    front), then waits for the rest."""
    parts = min(parts or threads(), count // max(1, min_part))
    if parts <= 1 or threads() == 1 or getattr(_running_part, 'active', False):
        work(0, count)
        return
    bounds = [count * i // parts for i in range(parts + 1)]
    errors = []

    def run(a, b):
        _running_part.active = True
        try:
            work(a, b)
        except BaseException as exc:      # every part runs or is waited for, then it raises
            errors.append(exc)
        finally:
            _running_part.active = False
    # each part in a copy of the caller's context: numpy's error state (np.errstate) with it
    futures = [_state['pool'].submit(contextvars.copy_context().run, run, a, b)
               for a, b in zip(bounds[1:-1], bounds[2:])]
    run(bounds[0], bounds[1])
    for future, a, b in reversed(list(zip(futures, bounds[1:-1], bounds[2:]))):
        if future.cancel():
            run(a, b)
    for future in futures:
        if not future.cancelled():
            future.result()
    if errors:
        raise errors[0]


def split_rows(rows, row_size, work):
    """``split`` of ``rows`` rows of ``row_size`` elements for elementwise passes."""
    split(rows, work, max(1, PARALLEL_MIN_ELEMENTS // max(1, row_size)))


def blocks(xp, rows, row_size, work, itemsize=4):
    """Run ``work(r0, r1)`` over ``rows`` rows of ``row_size`` elements: on numpy in blocks
    of about BLOCK_BYTES split over threads, elsewhere (CuPy) once over all rows."""
    per_block = max(1, BLOCK_BYTES // max(1, row_size * itemsize))
    if xp is not np or rows <= per_block:     # one block is too little to split
        work(0, rows)
        return

    def part(start, stop):
        for first in range(start, stop, per_block):
            work(first, min(stop, first + per_block))
    split_rows(rows, row_size, part)


def matmul(a, b, out=None, accumulate=False):
    """``out = a @ b`` (or ``out += a @ b``) for 2-D arrays. numpy ones are split over
    threads by rows or columns of the output, and accumulating needs no temporary of the
    output's size; others (CuPy) are left to their library."""
    if not isinstance(a, np.ndarray):
        if out is None:
            return a @ b
        if accumulate:
            out += a @ b
        else:
            out[...] = a @ b
        return out
    threads()
    _single_threaded_blas()
    m, n = a.shape[0], b.shape[1]
    if out is None:
        out = np.empty((m, n), np.result_type(a, b))
    parts = threads() if m * n * a.shape[1] >= PARALLEL_GEMM_MIN_FLOPS else 1
    if accumulate:        # in chunks that fit a cache, added to ``out``, along its longer side
        memory_bound = a.shape[1] < MEMORY_BOUND_INNER
        by_rows = memory_bound or m >= n
        chunk = ACCUMULATE_CACHED_BYTES if memory_bound else ACCUMULATE_CHUNK_BYTES
        span = max(1, chunk // (out.itemsize * (n if by_rows else m)))

        def work(start, stop):
            scratch = scratch_array('gemm', ((min(span, stop - start), n) if by_rows else
                                             (m, min(span, stop - start))), out.dtype)
            for first in range(start, stop, span):
                last = min(stop, first + span)
                if by_rows:
                    part = scratch[:last - first]
                    _gemm(a[first:last], b, part)
                    out[first:last] += part
                else:
                    part = scratch[:, :last - first]
                    _gemm(a, b[:, first:last], part)
                    out[:, first:last] += part
        split(m if by_rows else n, work, parts=parts)
    elif parts == 1:
        _gemm(a, b, out)
    elif m >= n:
        split(m, lambda s, e: _gemm(a[s:e], b, out[s:e]), parts=parts)
    else:
        split(n, lambda s, e: _gemm(a, b[:, s:e], out[:, s:e]), parts=parts)
    return out


def _gemm(a, b, out):
    """``out = a @ b``. An inner dimension of 1 (an outer product: the weight gradient
    of a fully connected layer at batch 1) is a broadcast product: numpy's matmul takes
    ten times longer for it than for an inner dimension of 2. Each output is the one
    product either way; half operands multiply in float32, rounded once into ``out``."""
    if a.shape[1] == 1:
        np.multiply(a, b, out=out, dtype=np.promote_types(out.dtype, np.float32))
    elif a.dtype.itemsize == 2 or b.dtype.itemsize == 2:
        _half_gemm(a, b, out)
    else:
        np.matmul(a, b, out=out)


def float32_operands(a, b):
    """``a`` and ``b``, in float32 where they are 16-bit floats (float16, bfloat16: mixed
    precision's activations and their diffs): numpy multiplies a float16 matrix in a loop
    of its own, ten to a hundred times slower than the BLAS, which then runs the product
    in float32 (as a GPU accumulates half products in float32); numpy rounds the result
    once into ``out``."""
    return [x.astype(np.float32) if x.dtype.itemsize == 2 else x for x in (a, b)]


def _half_gemm(a, b, out):
    """``out = a @ b`` with a 16-bit operand, on the BLAS in float32 (float32_operands),
    the operands converted ACCUMULATE_CHUNK_BYTES of float32 at a time along the longest
    of the three dimensions (the output's columns or rows, or the inner one, whose
    products add up in float32), so that no float32 copy of a large operand exists."""
    (m, k), n = a.shape, b.shape[1]
    if k >= max(m, n):
        span = max(1, ACCUMULATE_CHUNK_BYTES // (4 * (m + n)))
        total = np.zeros(out.shape, np.float32)
        for first in range(0, k, span):
            total += np.matmul(*float32_operands(a[:, first:first + span], b[first:first + span]))
        out[...] = total
    elif n >= m:
        span = max(1, ACCUMULATE_CHUNK_BYTES // (4 * k))
        for first in range(0, n, span):
            np.matmul(*float32_operands(a, b[:, first:first + span]),
                      out=out[:, first:first + span])
    else:
        span = max(1, ACCUMULATE_CHUNK_BYTES // (4 * k))
        for first in range(0, m, span):
            np.matmul(*float32_operands(a[first:first + span], b),
                      out=out[first:first + span])


def scratch_array(use, shape, dtype):
    """A C-ordered array of ``shape`` in this thread's buffer for ``use`` (a name), which
    grows as needed and is overwritten by the next call for the same use: for the parts
    of blocks (BLOCK_BYTES) and of GEMMs (ACCUMULATE_CHUNK_BYTES)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buffers = _scratch.__dict__.setdefault('buffers', {})
    buffer = buffers.get(use)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = buffers[use] = np.empty(nbytes, np.uint8)
    return buffer[:nbytes].view(dtype).reshape(shape)


def zeros(count, dtype):
    """``count`` zeros of ``dtype``, shared and read-only: an operand for elementwise
    passes, which numpy runs two to three times faster against an array than against
    a scalar (np.maximum(x, zeros) for ReLU)."""
    dtype = np.dtype(dtype)
    found = _zeros.get(dtype)
    if found is None or found.size < count:
        found = np.zeros(max(count, BLOCK_BYTES // dtype.itemsize), dtype)
        found.flags.writeable = False
        _zeros[dtype] = found
    return found[:count]


def batched_matmul(a, b, out=None):
    """``a @ b`` over leading axes that broadcast as numpy's matmul broadcasts them. numpy
    operands are split over threads, a product per part (or, for one product, by rows
    or columns: ``matmul``), where they are large enough, and otherwise go to numpy's
    matmul in one call; others (CuPy) are left to their library."""
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
        if out is None:
            return a @ b
        out[...] = a @ b
        return out
    lead = a.shape[:-2] if a.shape[:-2] == b.shape[:-2] else \
        np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if out is None:
        out = np.empty(lead + (a.shape[-2], b.shape[-1]), np.result_type(a, b))
    if math.prod(lead) == 1:          # one product (a convolution of one group): no views
        matmul(a[(0,) * (a.ndim - 2)], b[(0,) * (b.ndim - 2)], out=out[(0,) * len(lead)])
        return out
    threads()
    _single_threaded_blas()
    flops = out.size * a.shape[-1]
    if flops < PARALLEL_GEMM_MIN_FLOPS or threads() == 1 or getattr(_running_part, 'active',
                                                                    False):
        np.matmul(*float32_operands(a, b), out=out)   # one call: numpy runs them in turn, in C
        return out
    a = np.broadcast_to(a, lead + a.shape[-2:])
    b = np.broadcast_to(b, lead + b.shape[-2:])
    cells = list(np.ndindex(*lead))

    def work(start, stop):
        for cell in cells[start:stop]:
            np.matmul(*float32_operands(a[cell], b[cell]), out=out[cell])
    split(len(cells), work)
    return out
