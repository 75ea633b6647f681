"""Where the checkout and the reference data are: CAFFE_SYNCBN_SHARED, else the bundle of
`make gpu-bundle` (on a GPU machine the checkout stands alone), else ../shared, as
tools/gpu_check.py looks."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the SSD fork's outputs the detection tests hold the layers to (tests/ssd_golden/README.md)
SSD_GOLDEN = ROOT / 'tests' / 'ssd_golden'
BUNDLE = ROOT / '.gpu-bundle'
SHARED = Path(os.environ['CAFFE_SYNCBN_SHARED']) if os.environ.get('CAFFE_SYNCBN_SHARED') \
    else BUNDLE if BUNDLE.is_dir() else ROOT.parent / 'shared'
GOLDEN = SHARED / 'golden'
CORPUS = SHARED / 'corpus'
#: where the data must be there (CI, `make gpu-test`), its absence fails instead of skipping
REQUIRE_DATA = os.environ.get('CAFFE_SYNCBN_REQUIRE_DATA') == '1'


def require(path):
    if not path.exists():
        message = 'reference data not found at %s (set CAFFE_SYNCBN_SHARED)' % path
        if REQUIRE_DATA:
            pytest.fail(message + '; CAFFE_SYNCBN_REQUIRE_DATA=1 asks for it', pytrace=False)
        pytest.skip(message)
    return path
