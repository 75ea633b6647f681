"""Whole nets on the GPU: every golden case of BVLC Caffe, and data-parallel training with
same-GPU replicas against one replica and against the CPU."""
import numpy as np
import pytest

from gpu_support import require_gpu

cupy = require_gpu()
pytestmark = pytest.mark.gpu

import caffe_syncbn as caffe                                            # noqa: E402
from test_data_parallel import (batches, check_a_failing_replica_stops_all,  # noqa: E402
                                check_replicas_equal_one, max_difference, train)
from test_golden_nets import cases, run_case                            # noqa: E402


@pytest.fixture
def gpu_mode():
    caffe.set_mode_gpu()
    caffe.set_device(0)
    yield
    caffe.set_mode_cpu()


@pytest.mark.parametrize('name', cases())
def test_golden_case_on_gpu(name, monkeypatch, gpu_mode):
    run_case(name, monkeypatch)


@pytest.mark.parametrize('split', [None, (5, 4, 4, 3), (7, 0, 6, 3)])
def test_four_replicas_on_one_gpu_equal_one_replica(split):
    check_replicas_equal_one('gpu:0', 'gpu:0,0,0,0', split)


@pytest.mark.parametrize('dtype,tol', [(np.float64, 1e-10), (np.float32, 1e-4)])
def test_gpu_equals_cpu_after_five_steps(dtype, tol):
    data = batches(5, seed=2)
    cpu, cpu_stats = train('cpu:2', data, dtype=dtype)
    gpu, gpu_stats = train('gpu:0,0', data, dtype=dtype)
    assert max_difference(cpu[0], gpu[0]) <= tol
    assert max_difference(cpu_stats[0], gpu_stats[0]) <= tol


@pytest.mark.timeout(120)
def test_a_failing_gpu_replica_stops_all():
    check_a_failing_replica_stops_all('gpu:0,0,0,0')
