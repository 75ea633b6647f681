import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the reference data: CAFFE_SYNCBN_SHARED, else the bundle of `make gpu-bundle` (on a GPU
#: machine the checkout stands alone), else ../shared, as tools/gpu_check.py looks
BUNDLE = ROOT / '.gpu-bundle'
SHARED = Path(os.environ['CAFFE_SYNCBN_SHARED']) if os.environ.get('CAFFE_SYNCBN_SHARED') \
    else BUNDLE if BUNDLE.is_dir() else ROOT.parent / 'shared'
GOLDEN = SHARED / 'golden'
CORPUS = SHARED / 'corpus'
#: where the data must be there (CI, `make gpu-test`), its absence fails instead of skipping
REQUIRE_DATA = os.environ.get('CAFFE_SYNCBN_REQUIRE_DATA') == '1'
sys.path.insert(0, str(ROOT))

from caffe_syncbn.backend import cpu_threads  # noqa: E402  (from the checkout)


def require(path):
    if not path.exists():
        message = 'reference data not found at %s (set CAFFE_SYNCBN_SHARED)' % path
        if REQUIRE_DATA:
            pytest.fail(message + '; CAFFE_SYNCBN_REQUIRE_DATA=1 asks for it', pytrace=False)
        pytest.skip(message)
    return path


@pytest.fixture(params=[1, 2, 3], ids=lambda n: '%d threads' % n)
def threads(request):
    """The host path on 1, 2 and 3 threads of cpu_threads, then the count before again."""
    before = cpu_threads.threads()
    cpu_threads.set_threads(request.param)
    yield request.param
    cpu_threads.set_threads(before)


def randn(*shape, seed=0):
    return np.random.RandomState(seed).standard_normal(shape)
