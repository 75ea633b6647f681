"""The suite's fixtures; what the tests share is in the helpers package."""
import logging
import sys

import pytest

from helpers.paths import ROOT

sys.path.insert(0, str(ROOT))

from caffe_syncbn.backend import cpu_threads  # noqa: E402  (from the checkout)
from helpers import engines  # noqa: E402


@pytest.fixture(params=[1, 2, 3], ids=lambda n: '%d threads' % n)
def threads(request):
    """The host path on 1, 2 and 3 threads of cpu_threads, then the count before again."""
    before = cpu_threads.threads()
    cpu_threads.set_threads(request.param)
    yield request.param
    cpu_threads.set_threads(before)


@pytest.fixture(params=[pytest.param(name, marks=[pytest.mark.gpu] if name == 'gpu' else [])
                        for name in engines.NAMES])
def engine(request, monkeypatch):
    """The test on every engine of the layer's family: array, host, the CUDA kernels on the
    CPU emulation of the GPU runtime, and a GPU when CuPy sees one (helpers/engines.py)."""
    return engines.Engine(request.param, monkeypatch)


@pytest.fixture(params=engines.HOST_NAMES)
def host_engine(request, monkeypatch):
    """The engines that run on the host (array, host): for finite differences in float64."""
    return engines.Engine(request.param, monkeypatch)


@pytest.fixture
def records():
    """The log records of the package's logger while the test runs."""
    caught = []
    handler = logging.Handler()
    handler.emit = caught.append
    logger = logging.getLogger('caffe_syncbn')
    logger.addHandler(handler)
    yield caught
    logger.removeHandler(handler)
