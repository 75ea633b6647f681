"""A solver's snapshot files: their names, the layout of their weights and history (its
own net's, or the prototxt the user wrote), and the check that they can be written.

Under --sync-bn a solver trains a converted net (SyncBN layers), but the files it reads and
writes are laid out as the prototxt the user wrote (``UserLayout``): a snapshot's caffemodel
holds that net's BatchNorm+Scale or BN layers (a BatchNorm's sums and scale factor as the
SyncBN made of it kept them, which are Caffe's own), and its solverstate's history is laid
out as that net's learnable params are, so stock Caffe loads both and our tools read them
with or without --sync-bn. Without a conversion the net's own layout applies
(``NetLayout``). Both have one small interface: ``load_weights``, ``save``, ``history_out``
and ``history_in``, and on top of it ``write_solver_state``, ``read_solver_state`` and
``load_learned_net``. A solverstate's history holds ``sets`` arrays per learnable param (2
for Adam and AdaDelta), set after set.
"""
import logging
import os
import tempfile

import numpy as np

from ..backend import get_array_module, to_numpy
from ..errors import CaffeError, quote
from ..formats.caffemodel import Record, write_records, write_records_hdf5
from ..formats.solverstate import SolverState, read_solver_state, write_solver_state
from ..netparam.graph import filter_net, insert_splits
from ..weights.copy import copy_weights
from ..syncbn_policy import NVCAFFE_BATCHNORM
from ..weights.norm_forms import fit_norm_weights, norm_units

log = logging.getLogger('caffe_syncbn')

#: the index of NVCaffe BatchNorm's scale, after its three statistics blobs
_NVCAFFE_SCALE = 3


def snapshot_names(prefix, iteration, hdf5):
    """The weights' and the solver state's file names of a snapshot, as Caffe names them."""
    start = '%s_iter_%d' % (prefix, iteration)
    if hdf5:
        return start + '.caffemodel.h5', start + '.solverstate.h5'
    return start + '.caffemodel', start + '.solverstate'


def restore_solver(solver, path):
    """``solver`` continues from the ``.solverstate`` / ``.solverstate.h5`` at ``path``
    (Caffe's or ours): its learned net, its rule's history, its iteration and lr step."""
    layout = solver.snapshot_layout
    state, saved = layout.read_solver_state(path, solver.rule.history_per_param,
                                            "a %s solver on net '%s'"
                                            % (solver.param.type, solver.net.name))
    solver.lr_policy.check_resume(state.iter, state.current_step, path)

    def restore_arrays():
        layout.load_learned_net(state.learned_net, path)
        for saved_array, mine in zip(saved, solver.rule.history):
            mine[...] = get_array_module(mine).asarray(saved_array, dtype=mine.dtype)
    solver.on_net_device(restore_arrays)
    solver.iter = state.iter
    solver.lr_policy.current_step = state.current_step
    log.info('%s: restored iteration %d from %s', type(solver).__name__, solver.iter, path)


def snapshot_prefix_problem(prefix):
    """Why snapshots cannot be written at ``prefix`` (a path and the start of a name), or
    None. The probe is a file of a name no other process uses, created exclusively (never
    a name that a link planted beforehand could redirect), in the form of an interrupted
    write's temporary (formats/atomic.py), so that a later run removes it should this
    process die before it does."""
    folder, start = os.path.split(os.path.abspath(prefix))
    try:
        fd, probe = tempfile.mkstemp(prefix='.%s_iter_0.%d.' % (start, os.getpid()),
                                     suffix='.tmp', dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError:
        return ("cannot write to snapshot prefix '%s'; make sure its folder exists and is "
                'writable' % prefix)
    return None


def net_slots(net):
    """(layer name, blob index) of each of ``net.learnable_params``, in their order."""
    index = {id(blob): k for k, blob in enumerate(net.learnable_params)}
    slots = [None] * len(index)
    for name, layer in zip(net._layer_names, net.layers):
        for j, blob in enumerate(layer.blobs):
            k = index.get(id(blob))
            if k is not None and slots[k] is None:
                slots[k] = (name, j)
    return slots


def _size(shape):
    return int(np.prod(shape, dtype=np.int64))


def _fit_layout(saved, path, layouts, needs):
    """(index of the first layout, a list of shapes, that ``saved`` fits; the arrays
    reshaped to it), or a CaffeError that says what does not fit."""
    for k, shapes in enumerate(layouts):
        if len(saved) == len(shapes) and all(a.size == _size(s) for a, s in zip(saved, shapes)):
            return k, [a.reshape(s) for a, s in zip(saved, shapes)]
    for shapes in layouts:
        if len(saved) == len(shapes):
            bad = next(i for i, (a, s) in enumerate(zip(saved, shapes)) if a.size != _size(s))
            raise CaffeError('solver state %s: history blob %d has shape %s, the net needs %s'
                             % (path, bad, saved[bad].shape, tuple(shapes[bad])))
    raise CaffeError('solver state %s has %d history blobs, but %s needs %s'
                     % (path, len(saved), needs, ' or '.join(str(len(s)) for s in layouts)))


class NetLayout:
    """Files laid out as the net itself is."""

    def __init__(self, net):
        self.net = net

    def load_weights(self, net, path, complete=False):
        """Load a caffemodel into ``net``; with ``complete`` every layer with params must
        be in it (a snapshot of this net)."""
        net.copy_from(path, complete=complete)

    def save(self, path, hdf5):
        """Write the net's weights as a caffemodel (HDF5 if ``hdf5``)."""
        (self.net.save_hdf5 if hdf5 else self.net.save)(path)

    def write_snapshot(self, prefix, iteration, hdf5, current_step, history):
        """Caffe's snapshot of iteration ``iteration`` at ``prefix``: the weights, then the
        solver state naming them, with Caffe's log lines; their two file names."""
        model, state = snapshot_names(prefix, iteration, hdf5)
        kind = 'HDF5' if hdf5 else 'binary proto'
        log.info('Snapshotting to %s file %s', kind, model)
        self.save(model, hdf5)
        log.info('Snapshotting solver state to %s file %s', kind, state)
        self.write_solver_state(state, iteration, model, current_step, history)
        return model, state

    def write_solver_state(self, path, iteration, learned_net, current_step, history):
        """Write a solverstate, its history (a rule's) laid out as this layout's."""
        write_solver_state(path, SolverState(iteration, learned_net, current_step,
                                             self.history_out(history)))

    def read_solver_state(self, path, sets, needs):
        """A solverstate and its history, checked and shaped as a rule's history of ``sets``
        arrays per param; ``needs`` names the solver in errors."""
        state = read_solver_state(path)
        return state, self.history_in(state.history, path, sets, needs)

    def load_learned_net(self, name, state_path):
        """Load the weights a solverstate names (if any): all of this net's."""
        if not name:
            return
        weights = _find_learned_net(name, state_path)
        try:
            self.load_weights(self.net, weights, complete=True)
        except CaffeError as exc:
            raise CaffeError('solver state %s: %s' % (state_path, exc)) from None

    def history_out(self, history):
        return [to_numpy(h) for h in history]

    def history_in(self, saved, path, sets, needs):
        """The saved history arrays, checked and shaped as the rule's history; ``needs``
        names the solver in errors."""
        shapes = [blob.shape for blob in self.net.learnable_params] * sets
        return _fit_layout(saved, path, [shapes], needs)[1]


class UserLayout(NetLayout):
    """Files laid out as ``user_param``, the NetParameter (with its NetState) that ``net``
    was converted from."""

    def __init__(self, user_param, net):
        super().__init__(net)
        self.source_layers = list(user_param.layer)
        self.layers = list(insert_splits(filter_net(user_param, net.net_param.state)).layer)
        units = norm_units(self.layers)
        self._batchnorms = {u.name for u in units if u.kind == 'BatchNorm'}
        self._scale_of = {u.scale_name: u.name for u in units
                          if u.kind == 'BatchNorm' and u.scale_name is not None}
        # NVCaffe's BatchNorm: [mean, var, 1, scale, bias], made a SyncBN's [slope, bias, ...]
        self._nvcaffe = {u.name for u in units if u.kind == NVCAFFE_BATCHNORM}
        self.net_slots = net_slots(net)
        self.user_slots = self._owned_slots()
        # the net slot each user slot takes its values from; None: a BatchNorm's statistics,
        # which are never learned, so their history is zero
        self.source_of = {}
        for name, j in self.user_slots:
            if name in self._batchnorms or (name in self._nvcaffe and j < _NVCAFFE_SCALE):
                self.source_of[(name, j)] = None
            elif name in self._nvcaffe:
                self.source_of[(name, j)] = (name, j - _NVCAFFE_SCALE)
            else:
                self.source_of[(name, j)] = (self._scale_of.get(name, name), j)
        # what earlier versions wrote: the converted net's params, when a SyncBN made of a
        # BatchNorm had no scale factor blob (its blob 4)
        self.legacy_slots = [(name, j) for name, j in self.net_slots
                             if name not in self._batchnorms or j != 4]
        missing = sorted(set(self.source_of.values()) - set(self.net_slots) - {None})
        if missing:
            raise CaffeError("blob %d of layer '%s' of the prototxt has no counterpart in the "
                             'converted net' % missing[0][::-1])

    def _blob_count(self, layer):
        if layer.type == 'BatchNorm':
            return _NVCAFFE_SCALE + 2 if layer.name in self._nvcaffe else 3
        if layer.name in self._scale_of:
            return 1 + int(layer.scale_param.bias_term)
        net_layer = self.net.layer_by_name.get(layer.name)
        return len(net_layer.blobs) if net_layer is not None else 0

    def _owned_slots(self):
        """Caffe's learnable params of the user's net: a param whose ParamSpec name an
        earlier layer has already used is shared, not owned."""
        slots, names = [], set()
        for layer in self.layers:
            for j in range(self._blob_count(layer)):
                name = layer.param[j].name if j < len(layer.param) else ''
                if name in names:
                    continue
                if name:
                    names.add(name)
                slots.append((layer.name, j))
        return slots

    def _net_shape(self, slot):
        name, j = slot
        return self.net.layer_by_name[name].blobs[j].shape

    def _user_shape(self, slot):
        """BatchNorm's blobs are (C,), (C,), (1,) (NVCaffe's then (C,), (C,)); an absorbed
        Scale's are (C,)."""
        name, j = slot
        unit = self._scale_of.get(name, name if name in self._batchnorms | self._nvcaffe
                                  else None)
        if unit is None:
            return self._net_shape(slot)
        channels = self.net.layer_by_name[unit].blobs[0].count
        return (1,) if name in self._batchnorms | self._nvcaffe and j == 2 else (channels,)

    def load_weights(self, net, path, complete=False):
        copy_weights(net, path, source_layers=self.source_layers, complete=complete)

    def save(self, path, hdf5):
        own = {name: [to_numpy(b.data) for b in layer.blobs]
               for name, layer in zip(self.net._layer_names, self.net.layers) if layer.blobs}
        fitted = fit_norm_weights(self.layers, own, [layer.param for layer in self.net.layers],
                                  'the trained net')
        records = [Record(layer, fitted.get(layer.name, []), self.net.phase)
                   for layer in self.layers]
        if not hdf5:
            write_records(path, records, self.net.name)
            return
        owned = set(self.user_slots)
        write_records_hdf5(path, records, {(r.param.name, j) for r in records
                                           for j in range(len(r.arrays))
                                           if (r.param.name, j) not in owned})

    def history_out(self, history):
        index = {slot: k for k, slot in enumerate(self.net_slots)}
        per_set = len(self.net_slots)
        out = []
        for s in range(len(history) // per_set if per_set else 0):
            for slot in self.user_slots:
                source, shape = self.source_of[slot], self._user_shape(slot)
                out.append(np.zeros(shape, to_numpy(history[0]).dtype) if source is None
                           else to_numpy(history[s * per_set + index[source]]).reshape(shape))
        return out

    def history_in(self, saved, path, sets, needs):
        """Reads the user's layout (what we write) and the converted net's as earlier
        versions wrote it; what neither holds (statistics, never learned) is zero."""
        user = [self._user_shape(slot) for slot in self.user_slots] * sets
        legacy = [self._net_shape(slot) for slot in self.legacy_slots] * sets
        layout, arrays = _fit_layout(saved, path, [user, legacy], needs)
        if layout == 0:
            per_set = len(self.user_slots)
            where = {source: k for k, slot in enumerate(self.user_slots)
                     for source in [self.source_of[slot]] if source is not None}
        else:
            per_set = len(self.legacy_slots)
            where = {slot: k for k, slot in enumerate(self.legacy_slots)}
        out = []
        for s in range(sets):
            for slot in self.net_slots:
                k, shape = where.get(slot), self._net_shape(slot)
                out.append(np.zeros(shape, arrays[0].dtype) if k is None
                           else arrays[s * per_set + k].reshape(shape))
        return out


def _find_learned_net(name, state_path):
    """Caffe opens learned_net relative to the current directory; fall back to the state's folder."""
    if os.path.isabs(name) or os.path.exists(name):
        return name
    beside = os.path.join(os.path.dirname(os.path.abspath(state_path)), name)
    if os.path.exists(beside):
        return beside
    raise CaffeError('solver state %s names weights %s, found neither in %s nor next to the state'
                     % (state_path, quote(name), os.getcwd()))
