import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get('CAFFE_SYNCBN_SHARED', ROOT.parent / 'shared'))
GOLDEN = SHARED / 'golden'
CORPUS = SHARED / 'corpus'
#: where the data must be there (CI, `make gpu-test`), its absence fails instead of skipping
REQUIRE_DATA = os.environ.get('CAFFE_SYNCBN_REQUIRE_DATA') == '1'
sys.path.insert(0, str(ROOT))


def require(path):
    if not path.exists():
        message = 'reference data not found at %s (set CAFFE_SYNCBN_SHARED)' % path
        if REQUIRE_DATA:
            pytest.fail(message + '; CAFFE_SYNCBN_REQUIRE_DATA=1 asks for it', pytrace=False)
        pytest.skip(message)
    return path
