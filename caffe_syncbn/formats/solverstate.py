"""Solver snapshots (``.solverstate`` and ``.solverstate.h5``) in BVLC Caffe's exact layout.

BINARYPROTO: a SolverState message (iter, learned_net, history, current_step); each
history entry is a BlobProto with ``shape`` and ``data`` (``double_data`` for float64),
byte for byte what Caffe writes. HDF5: int32 datasets ``iter`` and ``current_step`` of
shape (1,), a NULL-terminated ASCII string ``learned_net`` and a group ``history`` with
datasets ``0``..``K-1``. Real Caffe reads what this module writes, and the other way
round. Files are written to a temporary name and renamed into place, so an interrupted
snapshot leaves the previous one intact.
"""
import os

import numpy as np

from .. import caffe_pb2
from ..errors import CaffeError
from .atomic import atomic_write
from .blobs import array_to_blob, blob_to_array, is_hdf5, parse_binary_file
from .file_kind import binary_kind, hdf5_kind, wrong_kind
from .hdf5 import read_dataset, reading, refuse_other_files, writing
from .regular import require_regular


class SolverState:
    """What a snapshot holds. ``history`` is a list of host arrays in Caffe's order."""

    def __init__(self, iteration=0, learned_net='', current_step=0, history=()):
        self.iter = int(iteration)
        self.learned_net = learned_net
        self.current_step = int(current_step)
        self.history = list(history)

    def __repr__(self):
        return 'SolverState(iter=%d, learned_net=%r, current_step=%d, %d history arrays)' % (
            self.iter, self.learned_net, self.current_step, len(self.history))


def read_solver_state(path):
    """Read a ``.solverstate`` or a ``.solverstate.h5`` file (told apart by suffix or content)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CaffeError('solver state %s: no such file' % path)
    require_regular(path, 'solver state')
    if is_hdf5(path):
        with reading(path, 'HDF5 solver state'):
            return _read_hdf5(path)
    error = wrong_kind(path, binary_kind(path), 'a solver state')
    if error is not None:
        raise error
    return _read_binary(path)


def write_solver_state(path, state):
    """Write ``state`` atomically; the format follows the ``.h5`` suffix as in Caffe."""
    path = os.fspath(path)
    if path.endswith('.h5'):
        with writing(path) as f:
            _write_hdf5(f, state)
    else:
        data = _to_proto(state).SerializeToString()
        with atomic_write(path) as f:
            f.write(data)


# ---- BINARYPROTO ---------------------------------------------------------------------------
def _to_proto(state):
    proto = caffe_pb2.SolverState()
    proto.iter = state.iter
    proto.learned_net = state.learned_net
    proto.current_step = state.current_step
    for array in state.history:
        array_to_blob(array, proto.history.add())
    return proto


def _read_binary(path):
    proto = parse_binary_file(path, caffe_pb2.SolverState)
    history = []
    for i, blob in enumerate(proto.history):
        try:
            history.append(blob_to_array(blob))
        except CaffeError as exc:
            raise CaffeError('solver state %s: history blob %d: %s' % (path, i, exc)) from None
    learned_net = proto.learned_net      # bytes where it is not UTF-8: a path all the same
    if isinstance(learned_net, bytes):
        learned_net = learned_net.decode('utf-8', 'surrogateescape')
    return SolverState(proto.iter, learned_net, proto.current_step, history)


# ---- HDF5 ----------------------------------------------------------------------------------
def _write_hdf5(f, state):
    f.create_dataset('iter', data=np.array([state.iter], np.int32))
    _write_c_string(f, 'learned_net', state.learned_net)
    f.create_dataset('current_step', data=np.array([state.current_step], np.int32))
    group = f.create_group('history')
    for i, array in enumerate(state.history):
        array = np.asarray(array)
        dtype = np.float64 if array.dtype == np.float64 else np.float32
        group.create_dataset(str(i), data=array.astype(dtype))


def _write_c_string(f, name, text):
    """A scalar, NULL-terminated ASCII string, as HDF5's H5LTmake_dataset_string writes it."""
    import h5py
    raw = text.encode('utf-8', 'surrogateescape')
    string_type = h5py.h5t.C_S1.copy()
    string_type.set_size(len(raw) + 1)
    string_type.set_strpad(h5py.h5t.STR_NULLTERM)
    space = h5py.h5s.create(h5py.h5s.SCALAR)
    dataset = h5py.h5d.create(f.id, name.encode('ascii'), string_type, space)
    dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(raw + b'\0', dtype='S%d' % (len(raw) + 1)))
    dataset.close()


def _read_hdf5(path):
    import h5py
    with h5py.File(path, 'r') as f:
        refuse_other_files(f, 'solver state %s' % path)
        for key in ('iter', 'history'):
            if key not in f:
                raise wrong_kind(path, hdf5_kind(f), 'a solver state') or CaffeError(
                    "solver state %s has no '%s' (is it a .solverstate.h5?)" % (path, key))
        learned_net = ''
        if 'learned_net' in f:
            raw = f['learned_net'][()]
            if not isinstance(raw, bytes):
                raise CaffeError("solver state %s: 'learned_net' is not a string" % path)
            learned_net = raw.decode('utf-8', 'surrogateescape').rstrip('\0')
        current_step = _scalar_int(f, 'current_step', path) if 'current_step' in f else 0
        group = f['history']
        history = []
        for i in range(len(group)):
            if str(i) not in group:
                raise CaffeError("solver state %s: history has %d entries but no '%d'"
                                 % (path, len(group), i))
            data = read_dataset(group[str(i)], 'solver state %s: history blob %d' % (path, i))
            history.append(np.asarray(data, np.float64 if data.dtype == np.float64 else np.float32))
        return SolverState(_scalar_int(f, 'iter', path), learned_net, current_step, history)


def _scalar_int(f, name, path):
    values = np.asarray(read_dataset(f[name], 'solver state %s: %s' % (path, name))).reshape(-1)
    if values.size != 1 or values.dtype.kind not in 'iu':
        raise CaffeError("solver state %s: '%s' is not one integer" % (path, name))
    return int(values[0])
