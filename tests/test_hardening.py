"""Regression tests for issue #20, round two: images and weights files that are small on
disk but huge in memory, a log file on a full disk, files that are not regular files,
Python layers that are not layers, zero-sized blobs, Datum records of mixed shapes, and
snapshots that a power loss could lose."""
import os
import stat
import subprocess
import sys

import pytest
from fuzz_harness import short_folder

import caffe_syncbn as caffe
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.formats.atomic import atomic_write

from conftest import ROOT


@pytest.fixture
def tmp_path():
    with short_folder() as folder:
        yield folder


def one_line(message, *names):
    assert '\n' not in message and len(message) <= 300, message
    for name in names:
        assert str(name) in message, (name, message)
    return message


def error_of(function, *args, **kwargs):
    with pytest.raises(CaffeError) as info:
        function(*args, **kwargs)
    return str(info.value)


def write(path, text):
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return str(path)


# ---- durability -----------------------------------------------------------------------------
def test_atomic_write_syncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    """The rename lives in the folder: the folder is synced once the file has its name."""
    target = tmp_path / 'run_iter_1.caffemodel'
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append((stat.S_ISDIR(os.fstat(fd).st_mode), target.exists()))
        real_fsync(fd)
    monkeypatch.setattr(os, 'fsync', recording_fsync)
    with atomic_write(target) as f:
        f.write(b'weights')
    assert synced == [(False, False), (True, True)]
    assert target.read_bytes() == b'weights'


# ---- Python layers --------------------------------------------------------------------------
@pytest.mark.parametrize('module, layer, kind', [('os', 'system', 'a function'),
                                                 ('collections', 'OrderedDict', 'a class'),
                                                 ('os', 'sep', 'a str')])
def test_python_layer_that_is_not_a_layer_is_one_line(tmp_path, module, layer, kind):
    path = write(tmp_path / 'net.prototxt', 'layer { name: "py" type: "Python" top: "a" '
                 'python_param { module: "%s" layer: "%s" } }' % (module, layer))
    one_line(error_of(caffe.Net, path, caffe.TEST), path, "layer 'py'",
             '%s.%s is %s, not a subclass of caffe.Layer' % (module, layer, kind))


# ---- the log file on a full disk ------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists('/dev/full'), reason='needs /dev/full')
def test_log_file_on_a_full_disk_is_one_warning_and_the_log_goes_on(tmp_path):
    """/dev/full fails every write with ENOSPC, as a full disk does."""
    script = ('import logging; from caffe_syncbn.glog import setup_logging\n'
              'setup_logging("/dev/full")\n'
              'for i in range(200): logging.getLogger("caffe_syncbn").info("line %d", i)\n')
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert 'Logging error' not in done.stderr and 'Traceback' not in done.stderr, done.stderr
    warnings = [line for line in lines if line.startswith('W')]
    assert len(warnings) == 1, done.stderr
    one_line(warnings[0], 'cannot write the log file /dev/full: No space left on device',
             'the log goes on on stderr only')
    assert len(lines) == 201 and lines[-1].endswith('] line 199'), done.stderr
