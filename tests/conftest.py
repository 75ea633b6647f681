import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get('CAFFE_SYNCBN_SHARED', ROOT.parent / 'shared'))
GOLDEN = SHARED / 'golden'
CORPUS = SHARED / 'corpus'
sys.path.insert(0, str(ROOT))


def require(path):
    if not path.exists():
        pytest.skip('reference data not found at %s (set CAFFE_SYNCBN_SHARED)' % path)
    return path
