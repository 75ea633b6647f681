"""Regression tests for issue #20, round two: images and weights files that are small on
disk but huge in memory, a log file on a full disk, files that are not regular files,
Python layers that are not layers, zero-sized blobs, Datum records of mixed shapes, and
snapshots that a power loss could lose."""
import os
import stat

import pytest
from fuzz_harness import short_folder

import caffe_syncbn as caffe
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.formats.atomic import atomic_write


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
