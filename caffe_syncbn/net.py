"""Net: a NetParameter turned into layers and blobs, with pycaffe's interface.

The Net knows the Layer contract and the registry, never a concrete layer type.
"""
import collections
import contextlib
import logging
import os

import numpy as np

from . import layers  # noqa: F401  (importing the package registers the built-in layer types)
from . import caffe_pb2, net_batches, net_sharing
from .backend import mode_array_module
from .backend.one_caller import OneCaller, one_at_a_time
from .blob import format_bytes, memory_limit, out_of_memory_text, storage_of
from .errors import CaffeError, layer_error, name_list, quote
from .layer import TEST, TRAIN, LayerContext, create_layer
from .memory_planner import DEFAULT_PLAN, MemoryPlanner, NetWiring, check_plan
from .netparam.graph import automatic_top, filter_net, insert_splits, net_state
from .netparam.layer_lines import naming_net_file
from .netparam.upgrade import load_net_param
from .net_precision import new_top, retype_learned_tops
from .pass_reads import decide_before_pass, read_pass
from .precision import run_dtypes
from .weights.copy import copy_weights
from .weights.save import net_to_proto, write_caffemodel, write_hdf5

log = logging.getLogger('caffe_syncbn')
#: what a second thread that runs a pass on a busy Net is told (backend/one_caller.py)
PASSES_ONE_AT_A_TIME = ('a Net runs one pass at a time, its blobs holding one batch, as in Caffe; '
                        'give each thread a Net of its own, sharing the weights (share_with)')


class Net:
    """A Caffe net. ``Net(model, phase, weights=None)`` or pycaffe's old ``Net(model, weights, phase)``.

    model:   prototxt path or NetParameter
    phase:   TRAIN or TEST
    level, stages: the NetState used with include/exclude rules
    context: a LayerContext (backend, dtype, communicator) shared by every layer
    precision: without ``context``, 'float32' or a mixed precision, 'float16' or 'bfloat16'
             (precision.py: half activations, float32 params; net_precision.py)
    memory_plan: one of memory_planner.PLANS; 'off' keeps every blob, as pycaffe's Net
             does; the others share storage by liveness (a TEST net without force_backward
             then runs forward only), and ``net.blobs`` holds the inputs, the outputs and
             the blobs named in ``keep``. ``net.planner`` is the net's MemoryPlanner, and
             ``net.memory_plan`` the plan it took ('auto' names its choice).
    ``net.loss_scale`` multiplies the loss weights that the backward starts from (1; a
    float16 solver's dynamic loss scale, training/loss_scale.py).
    """

    def __init__(self, model, phase=None, weights=None, level=0, stages=(), context=None,
                 dtype=None, memory_plan=DEFAULT_PLAN['pycaffe'], keep=(), precision='float32'):
        if isinstance(phase, (str, os.PathLike)):          # old form Net(model, weights, phase)
            phase, weights = weights, phase
        if phase is None:
            raise CaffeError('Net needs a phase: TRAIN or TEST')
        if context is None:
            dtype, activations = run_dtypes(precision, dtype)
            context = LayerContext(phase=phase, xp=mode_array_module(), dtype=dtype,
                                   activation_dtype=activations)
        context.phase = phase
        self.context = context
        self.phase = phase
        param = load_net_param(model)
        self.net_param = insert_splits(filter_net(param, net_state(param, phase, level, stages)))
        self.name = param.name
        self._one_caller = OneCaller("net '%s'" % self.name, PASSES_ONE_AT_A_TIME)
        self.loss_scale = 1.0
        check_plan(memory_plan)
        if isinstance(model, caffe_pb2.NetParameter):
            self._build()
        else:
            with naming_net_file(os.fspath(model), self.net_param):
                self._build()
        self.planner = MemoryPlanner(memory_plan, NetWiring(
            self.net_param, phase, context.xp, self.layers, self._bottoms, self._tops,
            self._loss_weights, self._layer_need_backward, self._bottom_need_backward,
            self.blobs, self.inputs, self.outputs), keep)
        self.blobs = self.planner.shown_blobs()
        if weights:
            self.copy_from(weights)

    # ---- construction -------------------------------------------------------------------
    def _build(self):
        ctx = self.context
        self.blobs = collections.OrderedDict()
        self.layers, self._layer_names = [], []
        self.bottom_names, self.top_names = collections.OrderedDict(), collections.OrderedDict()
        self._bottoms, self._tops, self._loss_weights = [], [], []
        self.learnable_params, self.params_lr, self.params_weight_decay = [], [], []
        owners, explicit_mults = {}, {}
        blob_need_backward = {}
        layer_need_backward, bottom_need_backward = [], []
        available = set()             # Caffe's rule for outputs: produced and not consumed since
        sized, total_bytes, limit = {}, 0, memory_limit()
        for lp in self.net_param.layer:
            # Caffe accepts repeated layer names (mnist_autoencoder has two 'loss' layers);
            # lookups by name then find the last one, as Caffe's layer_by_name does.
            layer = create_layer(lp, ctx)
            bottoms, need_backward, bottom_needs = [], False, []
            for j, name in enumerate(lp.bottom):
                if name not in self.blobs:
                    raise layer_error(lp, 'unknown bottom blob %s (no earlier layer produces it; '
                                      'known blobs: %s)' % (quote(name), name_list(self.blobs)))
                bottoms.append(self.blobs[name])
                available.discard(name)
                needs = blob_need_backward[name]
                if len(lp.propagate_down) > 0:
                    if len(lp.propagate_down) != len(lp.bottom):
                        raise layer_error(lp, 'propagate_down has %d entries for %d bottoms'
                                          % (len(lp.propagate_down), len(lp.bottom)))
                    needs = lp.propagate_down[j]
                bottom_needs.append(needs)
                need_backward |= blob_need_backward[name]
            if layer.is_loss and not lp.top:
                lp.top.append(automatic_top(self.net_param, lp))
            weights = [lp.loss_weight[j] if j < len(lp.loss_weight) else
                       (1.0 if layer.is_loss and j == 0 else 0.0) for j in range(len(lp.top))]
            tops, new_tops = [], []
            for j, name in enumerate(lp.top):
                if name in lp.bottom:
                    tops.append(self.blobs[name])             # in place
                elif name in self.blobs:
                    raise layer_error(lp, 'top blob %s is produced by more than one layer'
                                      % quote(name))
                else:
                    self.blobs[name] = new_top(ctx, layer, j, bottoms, weights[j])
                    tops.append(self.blobs[name])
                    new_tops.append((j, self.blobs[name]))
                available.add(name)
            try:
                layer.setup(bottoms, tops)
                retype_learned_tops(ctx, layer, new_tops, weights)
                layer.reshape(bottoms, tops)
            except (CaffeError, MemoryError) as exc:
                if getattr(exc, 'layer', None) is not None:
                    raise
                raise layer_error(lp, out_of_memory_text(exc) if isinstance(exc, MemoryError)
                                  else str(exc)) from None
            for blob in tops + layer.blobs:      # views (Split, Reshape tops) count once
                owner = storage_of(blob.data)
                if id(owner) not in sized:
                    sized[id(owner)] = owner         # kept, so that no other array takes its id
                    total_bytes += owner.nbytes
            if total_bytes > limit:
                raise layer_error(lp, "the net's blobs up to this layer need %s, more than the "
                                  'memory limit of %s' % (format_bytes(total_bytes),
                                                          format_bytes(limit)))
            if len(lp.param) > len(layer.blobs):
                raise layer_error(lp, '%d param specs given for %d learnable blobs'
                                  % (len(lp.param), len(layer.blobs)))
            for j, blob in enumerate(layer.blobs):
                wants_grad = self._register_param(lp, layer, j, blob, owners, explicit_mults)
                need_backward |= wants_grad
            for name in lp.top:
                blob_need_backward[name] = need_backward
            self.layers.append(layer)
            self._layer_names.append(lp.name)
            self.bottom_names[lp.name] = list(lp.bottom)
            self.top_names[lp.name] = list(lp.top)
            self._bottoms.append(bottoms)
            self._tops.append(tops)
            self._loss_weights.append(weights)
            layer_need_backward.append(need_backward)
            bottom_need_backward.append(bottom_needs)
        self._mark_backward(layer_need_backward, bottom_need_backward)
        self.layer_by_name = dict(zip(self._layer_names, self.layers))
        self.params = self._params_by_layer()
        self.inputs = [name for lp in self.net_param.layer if lp.type == 'Input' for name in lp.top]
        self.outputs = sorted(available)          # Caffe lists them by name
        self.output_blob_loss_weights = {
            name: w for tops, ws in zip(self.top_names.values(), self._loss_weights)
            for name, w in zip(tops, ws) if w}
        self._write_loss_weights()

    def _params_by_layer(self):
        return collections.OrderedDict((name, layer.blobs) for name, layer in
                                       zip(self._layer_names, self.layers) if layer.blobs)

    def _register_param(self, lp, layer, j, blob, owners, explicit_mults):
        """Apply ParamSpec j (lr_mult, decay_mult, sharing); return whether it wants a gradient.

        ``explicit_mults[index]`` holds which of lr_mult/decay_mult the prototxt set for
        learnable param ``index``: a sharing layer may set one its owner left out (Caffe).
        """
        spec = lp.param[j] if j < len(lp.param) else caffe_pb2.ParamSpec()
        lr_mult, decay_mult = spec.lr_mult, spec.decay_mult
        fixed = layer.fixed_param_mults(j)
        if fixed is not None:
            lr_mult = fixed[0] if fixed[0] is not None else lr_mult
            decay_mult = fixed[1] if fixed[1] is not None else decay_mult
        while len(layer.param_propagate_down) <= j:
            layer.param_propagate_down.append(True)
        layer.param_propagate_down[j] = lr_mult != 0
        if spec.name and spec.name in owners:
            owner = owners[spec.name]
            if spec.share_mode == caffe_pb2.ParamSpec.PERMISSIVE:
                if owner.count != blob.count:
                    raise layer_error(lp, "shared param '%s' has %d values here but %d in its owner"
                                      % (spec.name, blob.count, owner.count))
            elif owner.shape != blob.shape:
                raise layer_error(lp, "shared param '%s' has shape %s here but %s in its owner "
                                  '(use share_mode: PERMISSIVE to share by count)'
                                  % (spec.name, blob.shape, owner.shape))
            index = self.learnable_params.index(owner)
            for field, values in (('lr_mult', self.params_lr), ('decay_mult', self.params_weight_decay)):
                if not spec.HasField(field):
                    continue
                value = getattr(spec, field)
                if field not in explicit_mults[index]:
                    values[index] = value
                    explicit_mults[index].add(field)
                elif value != values[index]:
                    raise layer_error(lp, "shared param '%s' has %s %g but its owner has %g"
                                      % (spec.name, field, value, values[index]))
            layer.blobs[j] = owner if owner.shape == blob.shape else owner.reshaped_view(blob.shape)
            return lr_mult != 0
        if spec.name:
            owners[spec.name] = blob
        forced = fixed or (None, None)
        explicit_mults[len(self.learnable_params)] = {
            f for f, value in zip(('lr_mult', 'decay_mult'), forced) if spec.HasField(f) or value is not None}
        self.learnable_params.append(blob)
        self.params_lr.append(lr_mult)
        self.params_weight_decay.append(decay_mult)
        return lr_mult != 0

    def _mark_backward(self, layer_need_backward, bottom_need_backward):
        """Caffe's rule: a layer runs backward only if it needs it and leads to a loss."""
        under_loss, skip = set(), set()
        for i in reversed(range(len(self.layers))):
            lp = self.net_param.layer[i]         # by index: layer names may repeat
            tops = lp.top
            contributes = any(w != 0 for w in self._loss_weights[i]) or any(t in under_loss for t in tops)
            skip_propagate = all(t in skip for t in tops) if tops else True
            if layer_need_backward[i] and skip_propagate:
                layer_need_backward[i] = False
                bottom_need_backward[i] = [False] * len(bottom_need_backward[i])
            if not contributes:
                layer_need_backward[i] = False
            for j, name in enumerate(lp.bottom):
                if contributes:
                    under_loss.add(name)
                else:
                    bottom_need_backward[i][j] = False
                if not bottom_need_backward[i][j]:
                    skip.add(name)
        if self.net_param.force_backward:
            for i, layer in enumerate(self.layers):
                layer_need_backward[i] = True
                bottom_need_backward[i] = [need or layer.allow_force_backward(j)
                                           for j, need in enumerate(bottom_need_backward[i])]
                layer.param_propagate_down = [True] * len(layer.blobs)
        self._layer_need_backward = layer_need_backward
        for layer, need in zip(self.layers, layer_need_backward):
            layer.backward_runs = need
        self._bottom_need_backward = bottom_need_backward

    def _write_loss_weights(self):
        """Caffe keeps each loss weight in its top's diff, where backward starts from."""
        for tops, weights in zip(self._tops, self._loss_weights):
            for blob, w in zip(tops, weights):
                if w:
                    blob.diff[...] = w

    # ---- running ------------------------------------------------------------------------
    def _index(self, name, default):
        if name is None:
            return default
        if name not in self.layer_by_name:
            raise CaffeError("no layer named '%s' in net '%s'" % (name, self.name))
        return self._layer_names.index(name)

    @one_at_a_time('forward')
    def forward_prefilled(self, start=0, end=None):
        """Run layers start..end (inclusive) on the blobs as they are; return the loss."""
        return read_pass(self.context, self._forward(start, end))

    def _forward(self, start, end):
        """The forward of layers start..end; the loss, on the net's device."""
        end = len(self.layers) - 1 if end is None else end
        planner = self.planner
        planner.before_forward(start)
        decide_before_pass(self.layers[start:end + 1], self.context.xp)
        loss = 0.0
        for i in range(start, end + 1):
            if i in planner.absorbed:
                continue                       # its head ran it
            layer, bottoms, tops = self.layers[i], self._bottoms[i], self._tops[i]
            try:
                layer.reshape(bottoms, tops)
                for k in planner.chains[i]:
                    self.layers[k].reshape(self._bottoms[k], self._tops[k])
                layer.forward(bottoms, tops)
            except MemoryError as exc:
                raise layer.error('forward: %s' % out_of_memory_text(exc)) from None
            for blob, w in zip(tops, self._loss_weights[i]):
                if w:
                    loss = loss + w * blob.data.sum().astype(np.float64)
                    blob.diff[...] = w * self.loss_scale
        return loss

    @one_at_a_time('backward')
    def backward_from(self, start=None, end=0, after_layer=None):
        """Run backward for layers start down to end (inclusive); ``after_layer(i)`` is called
        once layer i is through (run or skipped), e.g. to start reducing its gradients."""
        start = len(self.layers) - 1 if start is None else start
        planner = self.planner
        planner.check_backward()
        # under a loss scale an overflow is no fault: the solver skips that update, and says why
        with np.errstate(over='ignore', invalid='ignore') if self.loss_scale != 1 else \
                contextlib.nullcontext():
            for i in range(start, end - 1, -1):
                if i in planner.absorbed:
                    continue        # its head's backward runs it, and then covers its params
                planner.before_backward(i)
                if self._layer_need_backward[i]:
                    try:
                        self.layers[i].backward(self._tops[i], self._bottom_need_backward[i],
                                                self._bottoms[i])
                    except MemoryError as exc:
                        raise self.layers[i].error('backward: %s' % out_of_memory_text(exc)) \
                            from None
                if after_layer is not None:
                    after_layer(i)

    @one_at_a_time('forward')
    def forward(self, blobs=None, start=None, end=None, **inputs):
        """pycaffe's forward: set inputs by keyword, run, return {output name: array}."""
        for name, value in inputs.items():
            if name not in self.blobs:
                raise CaffeError("forward(): '%s' is not a blob of net '%s'" % (name, self.name))
            value = self.context.xp.asarray(value, dtype=self.context.dtype)
            blob = self.blobs[name]
            if blob.shape != value.shape:
                blob.reshape(value.shape)
            blob.data[...] = value
        start_i, end_i = self._index(start, 0), self._index(end, len(self.layers) - 1)
        self.planner.check_pass(start_i, end_i, backward=False)
        self.forward_prefilled(start_i, end_i)
        names = self.outputs if end is None else self.top_names[self._layer_names[end_i]]
        return {name: self.blobs[name].data for name in list(names) + list(blobs or [])}

    @one_at_a_time('backward')
    def backward(self, diffs=None, start=None, end=None, **top_diffs):
        """pycaffe's backward: set output diffs by keyword, run, return {input name: diff}."""
        for name, value in top_diffs.items():
            if name not in self.outputs:
                raise CaffeError("backward(): '%s' is not an output of net '%s'" % (name, self.name))
            self.blobs[name].diff[...] = self.context.xp.asarray(value)
        start_i, end_i = self._index(start, len(self.layers) - 1), self._index(end, 0)
        self.planner.check_pass(start_i, end_i, backward=True)
        self.backward_from(start_i, end_i)
        names = self.inputs if end is None else self.bottom_names[self._layer_names[end_i]]
        return {name: self.blobs[name].diff for name in list(names) + list(diffs or [])}

    def forward_all(self, blobs=None, **inputs):
        """pycaffe's forward_all: arrays of any length in batches of the net's batch size;
        {output name: numpy array} (net_batches.forward_all)."""
        return net_batches.forward_all(self, blobs, inputs)

    def forward_backward_all(self, blobs=None, diffs=None, **arrays):
        """pycaffe's forward_backward_all: input arrays and output diffs in batches;
        ({output: array}, {input: diff array}) (net_batches.forward_backward_all)."""
        return net_batches.forward_backward_all(self, blobs, diffs, arrays)

    @one_at_a_time('forward_backward')
    def forward_backward(self, after_layer=None):
        """One forward and backward pass; its loss, read once both are queued."""
        loss = self._forward(0, None)
        self.backward_from(after_layer=after_layer)
        return read_pass(self.context, loss)

    def reshape(self):
        for layer, bottoms, tops in zip(self.layers, self._bottoms, self._tops):
            layer.reshape(bottoms, tops)

    def clear_param_diffs(self):
        for blob in self.learnable_params:
            blob.diff[...] = 0

    # ---- weights ------------------------------------------------------------------------
    def copy_from(self, weights, complete=False):
        """Load weights by layer name: a caffemodel path (binary V1 or V2, or HDF5), a
        NetParameter, or {layer name: [arrays]} as the converters give them. Batch norms
        stored in another form (BatchNorm+Scale, BN, SyncBN) are converted on the way.
        Layers with params that get nothing are named in a warning; with ``complete``
        (a snapshot of this net) they are an error."""
        copy_weights(self, weights, complete=complete)

    def to_proto(self):
        """The net's NetParameter with every layer's blobs filled in (what save() writes)."""
        return net_to_proto(self)

    def save(self, path):
        write_caffemodel(self, os.fspath(path))

    def save_hdf5(self, path):
        write_hdf5(self, os.fspath(path))

    def load_hdf5(self, path):
        self.copy_from(path)

    def set_input_arrays(self, data, labels):
        """pycaffe's: hand arrays to the net's MemoryData layer (the first that takes them)."""
        for layer in self.layers:
            if hasattr(layer, 'set_input_arrays'):
                return layer.set_input_arrays(data, labels)
        raise CaffeError("net '%s' has no layer that takes input arrays (MemoryData)" % self.name)

    def share_with(self, other):
        """Caffe's ShareTrainedLayersWith: every layer here named as one of ``other``'s uses
        that layer's param data (not diffs), which must match in number and shape."""
        net_sharing.share_trained_layers(self, other)

    def share_weights_with(self, other):
        """Make this net's params the same Blobs as ``other``'s, by layer name (test nets)."""
        net_sharing.take_params(self, other)
        self.params = self._params_by_layer()

    @property
    def memory_plan(self):
        """The memory plan the net took (MemoryPlanner.chosen)."""
        return self.planner.chosen

    @property
    def layer_dict(self):
        return collections.OrderedDict(zip(self._layer_names, self.layers))

    @property
    def _blob_names(self):
        return list(self.blobs)

    @property
    def blob_loss_weights(self):
        return collections.OrderedDict((name, self.output_blob_loss_weights.get(name, 0.0))
                                       for name in self.blobs)

    def __repr__(self):
        return "Net('%s', %s, %d layers)" % (self.name, 'TRAIN' if self.phase == TRAIN else 'TEST',
                                              len(self.layers))


__all__ = ['Net', 'TRAIN', 'TEST', 'load_net_param']
