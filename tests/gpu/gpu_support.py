"""What every GPU test module starts with: ``cupy = require_gpu()``. It also puts the tests
folder on the path, so that the GPU tests share the helpers of the CPU tests."""
import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


def require_gpu():
    """Import CuPy and check for a device, or skip the calling module (the reason shows in
    the summary); modules also carry ``pytestmark = pytest.mark.gpu``."""
    try:
        import cupy
    except ImportError as exc:
        pytest.skip('GPU tests skipped: CuPy is not installed (%s)' % exc, allow_module_level=True)
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:            # no driver, or no device visible
        pytest.skip('GPU tests skipped: no CUDA device (%s)' % exc, allow_module_level=True)
    if count < 1:
        pytest.skip('GPU tests skipped: no CUDA device', allow_module_level=True)
    return cupy
