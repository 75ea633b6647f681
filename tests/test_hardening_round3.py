"""Regression tests for issue #34, round three: HDF5 files whose values are in other files
(external storage, external links, virtual datasets), two runs with one snapshot prefix,
an address-space limit above 2**63 bytes, Python layers named by a path or by the base
class, and an LMDB cut short while it is read."""
import os
import resource
import select
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from fuzz_harness import Worker, short_folder

import caffe_syncbn as caffe
from caffe_syncbn.blob import checked_shape, memory_limit
from caffe_syncbn.data.datum import array_to_datum, write_lmdb
from caffe_syncbn.data.lmdbfile import LMDBFile
from caffe_syncbn.errors import CaffeError
from caffe_syncbn.formats.caffemodel import read_weights
from caffe_syncbn.netparam.inputs import swap_data_layers_for_inputs
from caffe_syncbn.netparam.upgrade import load_net_param
from caffe_syncbn.pycaffe.caffe import get_solver

from conftest import ROOT

#: generous: a hang is the failure these bounds catch, and a loaded machine is no hang
TIMEOUT = 120
#: a net that trains on no files (DummyData)
NET = '''layer { name: "data" type: "DummyData" top: "data" top: "target"
  dummy_data_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
'''


@pytest.fixture
def tmp_path():
    with short_folder() as folder:
        yield folder


@pytest.fixture(scope='module')
def worker():
    worker = Worker(timeout=TIMEOUT)
    yield worker
    worker.close()


def one_line(message, *names):
    assert '\n' not in message and len(message) <= 300, message
    for name in names:
        assert str(name) in message, (name, message)
    return message


def error_of(function, *args, **kwargs):
    with pytest.raises(CaffeError) as info:
        function(*args, **kwargs)
    return str(info.value)


# ---- the memory limit ---------------------------------------------------------------------------
PHYSICAL = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')


@pytest.mark.parametrize('soft', [-1024, resource.RLIM_INFINITY, 2 ** 64 - 1, 2 ** 64 - 1024,
                                  2 ** 63])
def test_rlimits_that_do_not_fit_a_signed_64_bit_number_are_no_limit(monkeypatch, soft):
    """`ulimit -v` of 2**53 KiB or more reaches Python as a negative number (-1024 for
    2**64 - 1024 bytes): it limits nothing, and every net was refused."""
    monkeypatch.setattr(resource, 'getrlimit', lambda kind: (soft, soft))
    assert memory_limit() == PHYSICAL
    assert checked_shape((2, 3)) == (2, 3)


def test_a_real_address_space_limit_still_counts(monkeypatch):
    monkeypatch.setattr(resource, 'getrlimit', lambda kind: (1 << 30, resource.RLIM_INFINITY))
    assert memory_limit() == min(1 << 30, PHYSICAL)


def test_a_net_builds_under_ulimit_v_above_2_to_the_63(tmp_path):
    (tmp_path / 'net.prototxt').write_text(NET)
    script = 'import caffe_syncbn as caffe; caffe.Net("net.prototxt", caffe.TEST); print("built")'
    done = subprocess.run(['bash', '-c', 'ulimit -v 18014398509481983 && "$0" -c "$1"',
                           sys.executable, script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=TIMEOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0 and done.stdout.strip() == 'built', done.stderr[-2000:]


# ---- Python layers ------------------------------------------------------------------------------
class OnlyReshape(caffe.Layer):
    """A layer class that leaves forward to the base class."""

    def reshape(self, bottom, top):
        top[0].reshape(2)


@pytest.mark.parametrize('module', ['../probe', '.layer', 'tests/probe', 'a..b', 'probe.py '])
def test_a_python_module_named_by_a_path_or_relatively_is_one_line(tmp_path, module):
    path = tmp_path / 'net.prototxt'
    path.write_text('layer { name: "py" type: "Python" top: "a" '
                    'python_param { module: "%s" layer: "Probe" } }' % module)
    one_line(error_of(caffe.Net, str(path), caffe.TEST), str(path), "layer 'py'",
             "python_param module '%s' is not a module name" % module)


@pytest.mark.parametrize('module, layer, missing', [
    ('caffe_syncbn.layer', 'Layer', 'reshape and forward of the layer contract: it is '
                                    'caffe.Layer itself'),
    ('caffe_syncbn', 'Layer', 'reshape and forward'),
    ('test_hardening_round3', 'OnlyReshape', 'does not implement forward of the layer contract')])
def test_a_python_layer_class_without_the_layer_contract_is_one_line(tmp_path, module, layer,
                                                                      missing):
    path = tmp_path / 'net.prototxt'
    path.write_text('layer { name: "py" type: "Python" top: "a" '
                    'python_param { module: "%s" layer: "%s" } }' % (module, layer))
    one_line(error_of(caffe.Net, str(path), caffe.TEST), str(path), "layer 'py'",
             'python_param %s.%s does not implement' % (module, layer), missing)


# ---- LMDB ---------------------------------------------------------------------------------------
def test_an_lmdb_cut_short_while_read_names_the_size_it_has_then(tmp_path):
    """The size at open (every page there) is not where a copy cut short afterwards ends."""
    images = np.random.RandomState(0).randint(0, 256, (300, 3, 8, 8)).astype(np.uint8)
    write_lmdb(str(tmp_path / 'db'), [[(b'%05d' % i, array_to_datum(image, i).SerializeToString())
                                       for i, image in enumerate(images)]])
    data = tmp_path / 'db' / 'data.mdb'
    database = LMDBFile(str(data))
    records = database.records()
    next(records)
    opened_size = database.size
    cut = 3 * database.page_size
    os.truncate(data, cut)
    message = error_of(lambda: [None for _ in records])
    one_line(message, str(data), 'it ends at byte %d, inside a page' % cut)
    assert str(opened_size) not in message

