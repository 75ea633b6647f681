"""Out of memory mid-run (issue 34, item 4): under an address-space limit, set in a child
process with resource.setrlimit(RLIMIT_AS) a little above what it uses at that point,
a thread, a BLAS buffer or an array that does not fit is one error line naming the
thread pool or the layer and the bytes asked for, never a traceback or OpenBLAS's own
message; snapshots written before stay loadable.

The children have no deadline of their own: the bound on each is generous, for a
machine that runs another suite beside this one."""
import sys
import textwrap

import h5py
import numpy as np
import pytest
from threadpoolctl import threadpool_info

from helpers import watchdog
from helpers.paths import ROOT

#: the preamble of every child: limit(headroom) caps the address space at what the
#: process maps now plus ``headroom`` bytes
PREAMBLE = '''
import resource, sys
sys.path.insert(0, %r)
import numpy as np
import h5py
import caffe_syncbn as caffe
from caffe_syncbn import caffe_pb2
from caffe_syncbn.cli.commands import main
from caffe_syncbn.cli.common import run_main
from caffe_syncbn.netparam.prototxt import parse_text


def limit(headroom):
    with open('/proc/self/status') as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmSize:'))
    resource.setrlimit(resource.RLIMIT_AS, (used + headroom, resource.RLIM_INFINITY))
''' % str(ROOT)
MiB = 1 << 20


def run_child(folder, body, *args):
    script = folder / 'child.py'
    script.write_text(PREAMBLE + textwrap.dedent(body))
    return watchdog.run([sys.executable, str(script), *map(str, args)], cwd=folder,
                        capture_output=True, text=True, limit=600)


def error_line(result):
    """The child's one error line (the last of stderr), checked to be the only trace."""
    assert result.returncode == 1, result.stderr[-3000:]
    assert 'Traceback' not in result.stderr and 'OpenBLAS error' not in result.stdout, \
        result.stderr[-3000:] + result.stdout
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith('error: ') and len(line) <= 400, line
    return line


NET = '''name: "wide"
layer { name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "%(folder)s/list.txt" batch_size: 16 } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 512 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
'''

SOLVER = '''net: "%(folder)s/net.prototxt"
base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" max_iter: %(max_iter)d display: 1
snapshot: 2 snapshot_prefix: "%(folder)s/snap" random_seed: 1
'''


def wide_job(folder, max_iter=4):
    """A net whose GEMMs (16 x 512 x 512) take OpenBLAS's buffers, reading HDF5."""
    rs = np.random.RandomState(0)
    with h5py.File(folder / 'data.h5', 'w') as f:
        f['data'] = rs.standard_normal((64, 512)).astype(np.float32)
        f['label'] = rs.randint(0, 4, 64).astype(np.float32)
    (folder / 'list.txt').write_text(str(folder / 'data.h5') + '\n')
    (folder / 'net.prototxt').write_text(NET % {'folder': folder})
    (folder / 'solver.prototxt').write_text(SOLVER % {'folder': folder, 'max_iter': max_iter})
    return folder / 'solver.prototxt'


TRAIN = '''
headroom = int(sys.argv[2])
sys.argv = ['caffe-syncbn', 'train', '-solver', sys.argv[1], '-cpu_devices', '2']
limit(headroom)
run_main(main)
'''


def test_a_replica_thread_without_room_for_its_stack_is_one_line(tmp_path):
    """The replicas' worker threads start with the pool, before any net: 6 MiB of room
    cannot hold the first one's 8 MiB stack (was: RuntimeError: can't start new thread)."""
    line = error_line(run_child(tmp_path, TRAIN, wide_job(tmp_path), 6 * MiB))
    assert line.startswith('error: cannot start thread 1 of 1 of the worker of replica 0 (cpu:0; '
                           '2 replicas): '), line
    assert 'a thread asks for a stack of' in line and 'address space (ulimit -v)' in line, line


def test_the_host_pool_without_room_for_its_threads_is_one_line(tmp_path):
    line = error_line(run_child(tmp_path, '''
        from caffe_syncbn.backend import cpu_threads
        limit(6 << 20)
        try:
            cpu_threads.set_threads(3)
        except caffe.CaffeError as exc:
            sys.exit('error: %s' % exc)
        '''))
    assert line.startswith('error: cannot start thread 1 of 2 of the host thread pool '
                           '(CAFFE_SYNCBN_THREADS=3): '), line


@pytest.mark.skipif(not any(lib.get('internal_api') == 'openblas' for lib in threadpool_info()),
                    reason="numpy's BLAS is not OpenBLAS")
def test_no_room_for_openblas_buffers_is_one_line_before_the_first_iteration(tmp_path):
    """Two replicas' GEMMs take two 32 MiB buffers at once; 72 MiB of room hold the first
    (taken as the host pool starts), the threads' stacks and the nets, not the second: the
    run says so before the first iteration (was: OpenBLAS's C code printed 'Memory
    allocation still failed after 10 retries' and ended the process)."""
    result = run_child(tmp_path, TRAIN, wide_job(tmp_path), 72 * MiB)
    line = error_line(result)
    assert 'asks for a buffer of 32.0 MiB (33554432 bytes) in each of the 2 threads that call ' \
           'it at once' in line and 'address space (ulimit -v)' in line, line
    assert line.startswith('error: OpenBLAS '), line
    assert 'Starting Optimization' not in result.stderr


NET_OF_CONV = '''
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 64 dim: 32 dim: 32 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "y"
        convolution_param { num_output: 64 kernel_size: 3 pad: 1 } }
layer { name: "relu" type: "ReLU" bottom: "y" top: "z" }
'''

PASS = '''
case = sys.argv[1]
limit(400 << 20)               # as under ulimit -v from the start: the BLAS takes its buffers
net = caffe.Net(parse_text(%r, caffe_pb2.NetParameter()), caffe.TEST,
                memory_plan='share' if case == 'arena' else 'off')
net.forward()
net.blobs['x'].reshape(16, 64, 128, 128)     # 64 MiB, and so is each top
if case != 'top':
    net.reshape()                            # the tops (and plan) are there before the limit
limit(20 << 20)
try:
    net.forward()
except caffe.CaffeError as exc:
    sys.exit('error: %%s' %% exc)
''' % NET_OF_CONV


@pytest.mark.parametrize('case', ['top', 'scratch', 'arena'])
def test_an_allocation_of_a_pass_that_does_not_fit_names_the_layer_and_the_bytes(tmp_path, case):
    """A top blob, a convolution's buffer, the memory plan's arena (was: numpy's
    _ArrayMemoryError traceback from conv_columns.scratch, or a line without the layer)."""
    line = error_line(run_child(tmp_path, PASS, case))
    assert 'address space (ulimit -v)' in line, line
    if case == 'arena':
        assert line.startswith("error: out of memory: the arena of the net's memory plan (the "
                               'storage its blobs share) needs 64.0 MiB (67108864 bytes)'), line
        return
    assert line.startswith("error: layer 'conv' (type Convolution): forward: out of memory: "), line
    assert ' needs ' in line and ' bytes)' in line
    if case == 'top':
        assert 'a blob of shape [16, 64, 128, 128] needs 64.0 MiB (67108864 bytes)' in line, line


MID_RUN_SOLVER = '''base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" max_iter: 10 display: 1
snapshot: 2 snapshot_prefix: "snap" random_seed: 1
net_param {
  layer { name: "in" type: "Input" top: "data" top: "label"
          input_param { shape { dim: 16 dim: 512 } shape { dim: 16 } } }
  layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
          inner_product_param { num_output: 8192 weight_filler { type: "xavier" } } }
  layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
          inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
  layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
}
'''

MID_RUN = '''
rs = np.random.RandomState(0)
rows = [16]
solver = caffe.get_solver(sys.argv[1])
solver.set_data_source(lambda: {'data': rs.standard_normal((rows[0], 512)).astype(np.float32),
                                'label': rs.randint(0, 4, rows[0]).astype(np.float32)})
solver.step(4)
limit(16 << 20)
try:
    solver.snapshot()                   # 16 MiB of weights to serialize, and 16 of history
except MemoryError as exc:
    print('snapshot: %s' % type(exc).__name__, file=sys.stderr)
rows[0] = 2048                          # the input fits (4 MiB), ip1's top (64 MiB) does not
try:
    solver.step(1)
except caffe.CaffeError as exc:
    sys.exit('error: %s' % exc)
'''


def test_out_of_memory_mid_run_keeps_the_snapshots_written_before(tmp_path):
    """Four iterations with snapshots at 2 and 4; then, under a limit, a snapshot that runs
    out of memory leaves the one of the same iteration whole, and a batch 128 times as large
    ends the run with one line naming the layer."""
    (tmp_path / 'solver.prototxt').write_text(MID_RUN_SOLVER)
    result = run_child(tmp_path, MID_RUN, tmp_path / 'solver.prototxt')
    line = error_line(result)
    assert line.startswith("error: layer 'ip1' (type InnerProduct): forward: out of memory: "
                           'a blob of shape [2048, 8192] needs 64.0 MiB (67108864 bytes)'), line
    assert 'snapshot: ' in result.stderr, result.stderr[-2000:]
    from caffe_syncbn.formats.caffemodel import read_net_param
    from caffe_syncbn.formats.solverstate import read_solver_state
    for it in (2, 4):
        weights = read_net_param(str(tmp_path / ('snap_iter_%d.caffemodel' % it)))
        assert [len(layer.blobs[0].data) for layer in weights.layer if layer.blobs] == \
            [8192 * 512, 4 * 8192]
        assert read_solver_state(str(tmp_path / ('snap_iter_%d.solverstate' % it))).iter == it
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith('snap')) == [
        'snap_iter_2.caffemodel', 'snap_iter_2.solverstate', 'snap_iter_4.caffemodel',
        'snap_iter_4.solverstate']
