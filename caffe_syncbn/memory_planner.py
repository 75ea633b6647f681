"""How a Net takes memory under a plan (memory_plan.py): the chains its layers absorb, the
plan of a net that runs forward only or backward, 'auto''s choice, and the arena."""
import collections
import logging

from .blob import format_bytes, storage_of
from .caffe_pb2 import TEST
from .errors import CaffeError, name_list, quote
from .memory_plan import AUTO_SAVING, forward_plan, train_plan

log = logging.getLogger('caffe_syncbn')


class PlannedMemory:
    """What a Net adds to plan its memory; it needs the Net's layers, blobs, per-layer
    bottoms, tops, loss weights and backward flags, and ``reshape``."""

    def _plan_memory(self, keep, plan):
        unknown = [name for name in keep if name not in self.blobs]
        if unknown:
            raise CaffeError("keep: net '%s' has no blob %s" % (self.name, quote(unknown[0])))
        kept = set(self.inputs) | set(self.outputs) | set(keep)
        forward_only = self.phase == TEST and not self.net_param.force_backward
        if forward_only:
            self._layer_need_backward = [False] * len(self.layers)
            for layer in self.layers:          # nothing need be kept for a backward
                layer.backward_runs = False
        if plan in ('inplace_abn', 'recompute', 'auto'):
            self._chains = absorb_chains(self.layers, self._bottoms, self._tops, self._loss_weights,
                                         None if forward_only else (self._layer_need_backward,
                                                                    self._bottom_need_backward),
                                         [self.blobs[name] for name in kept])
            self._absorbed = {k for chain in self._chains for k in chain}
        persistent = [top for layer, tops in zip(self.layers, self._tops) if layer.tops_persist
                      for top in tops]
        kept_data = [self.blobs[name] for name in kept] + persistent
        # a chain's head writes its output in the forward and reads its diff in the backward
        tops = [t + [self._tops[k][0] for k in chain] for t, chain in zip(self._tops, self._chains)]
        if forward_only:
            self._plan = forward_plan(self._bottoms, tops, kept_data)
            self.memory_plan = 'inplace_abn' if plan == 'auto' else plan
        else:
            self._plan = self._train_plan(plan, tops, kept_data)
        self._apply_plan()
        self.blobs = KeptBlobs([(name, blob) for name, blob in self.blobs.items() if name in kept],
                               [name for name in self.blobs if name not in kept])

    def _train_plan(self, plan, tops, kept_data):
        """The plan of a net that runs backward; 'auto' takes 'recompute' where it saves
        enough (AUTO_SAVING), else 'inplace_abn'."""
        runs = [need and i not in self._absorbed for i, need in enumerate(self._layer_need_backward)]
        reads = [layer.backward_reads(bottoms, layer_tops) for layer, bottoms, layer_tops
                 in zip(self.layers, self._bottoms, self._tops)]
        kept_diff = kept_data + [self.blobs[name] for name in self.output_blob_loss_weights]

        def planned(recompute):
            rerunnable = {i: chain for i, (layer, chain) in enumerate(zip(self.layers, self._chains))
                          if recompute and i not in self._absorbed and layer.rerunnable()}
            return train_plan(self._bottoms, tops, reads, runs, self._bottom_need_backward,
                              kept_data, kept_diff, [b for t in tops for b in t if recompute
                                                     and id(b) in recomputers], rerunnable)

        recomputers = {id(top): layer for i, (layer, bottoms, layer_tops) in
                       enumerate(zip(self.layers, self._bottoms, self._tops))
                       if runs[i] for top in layer.recomputable(bottoms, layer_tops)}
        if plan != 'auto':
            self._recomputers = recomputers if plan == 'recompute' else {}
            return planned(plan == 'recompute')
        lean, full = planned(False), planned(True)
        lean_bytes, full_bytes = lean.planned_bytes(), full.planned_bytes()
        self.memory_plan = 'recompute' if full_bytes <= AUTO_SAVING * lean_bytes else 'inplace_abn'
        log.info("Net '%s': memory plan %s (an arena of %s; recompute %s, inplace_abn %s)",
                 self.name, self.memory_plan, format_bytes(min(full_bytes, lean_bytes)),
                 format_bytes(full_bytes), format_bytes(lean_bytes))
        if self.memory_plan == 'recompute':
            self._recomputers = recomputers
            return full
        return lean

    def _check_partial_pass(self, start, end, backward):
        """A pycaffe pass over layers [start, end] (backward: from start down to end) under a
        plan: it must not cut a chain that one layer runs, nor read a blob (in the forward)
        or a diff (in the backward) that a part of the net outside the pass wrote into
        shared storage, nor read a blob that recompute writes again outside the pass."""
        first, last = min(start, end), max(start, end)
        names = self._layer_names
        for head, chain in enumerate(self._chains):
            if chain and head <= last and first <= chain[-1] \
                    and not first <= head <= chain[-1] <= last:
                raise CaffeError("layer %s runs %s with it under memory_plan '%s': start "
                                 "and end the pass outside that chain, or pass "
                                 "memory_plan='off'" % (quote(names[head]), name_list(
                                     [names[k] for k in chain]), self.memory_plan))
        arena = self._plan.arena
        passed = range(first, last + 1)
        if not backward:
            outside = {id(top) for tops in self._tops[:first] for top in tops}
            for i in passed:
                for j, blob in enumerate(self._bottoms[i]):
                    if id(blob) in outside and storage_of(blob.data) is arena:
                        self._not_kept(i, 'blob', self.net_param.layer[i].bottom[j])
            return
        steps = 2 * len(self.layers)
        for i, groups in self._plan.refills.items():
            if i > last and any(steps - 1 - g.last <= last for g in groups):
                raise CaffeError("layer %s writes again, before its backward, a blob the "
                                 "backward of layers up to %s reads under memory_plan "
                                 "'recompute'; start the pass there or pass memory_plan='off'"
                                 % (quote(self._layer_names[i]), quote(self._layer_names[last])))
        later = {id(bottom) for bottoms in self._bottoms[last + 1:] for bottom in bottoms}
        for i in reversed(passed):
            for j, blob in enumerate(self._tops[i]):
                if id(blob) in later and blob.diff_if_made is not None and \
                        storage_of(blob.diff_if_made) is arena:
                    self._not_kept(i, 'the diff of blob', self.net_param.layer[i].top[j])

    def _not_kept(self, i, what, name):
        """Layer i needs the shared blob ``name``, said as the prototxt names it (a Split's
        top by the blob it splits)."""
        layers = self.net_param.layer
        splits = {top: lp.bottom[0] for lp in layers if lp.type == 'Split' for top in lp.top}
        while name in splits:
            name = splits[name]
        raise CaffeError("layer %s reads %s %s, which the memory plan shares and a part of "
                         "the net outside this pass writes; pass keep=[%s] or memory_plan='off'"
                         % (quote(self._layer_names[i]), what, quote(name), quote(name)))

    def _input_shapes(self):
        return [self.blobs[name].shape for name in self.inputs]

    def _apply_plan(self):
        self.reshape()                         # sized for the inputs as they are now
        planned = self._plan.apply(self.context.xp)
        self.reshape()                         # the aliases take views of the new storage
        self._planned_inputs = self._input_shapes()
        log.debug("Net '%s': %d planned groups share %s", self.name, len(self._plan.groups),
                  format_bytes(planned))


def absorb_chains(layers, bottoms, tops, loss_weights, backward_flags, kept):
    """Offer each layer the layers that follow it in a chain (Layer.absorb); returns, per
    layer, the indices of the layers it absorbed, and sets ``output_survives`` on each head.

    Layer k continues the chain that ends with layer e when it reads only e's one top and
    writes one top, no loss, and e's top is no other layer's input nor ``kept`` (unless k
    writes it in place). ``backward_flags`` (the Net's per-layer need_backward and per-bottom
    flags; None in a net that runs forward only): a chain runs its backward as one, so its
    layers must agree on it."""
    consumers = collections.Counter(id(b) for layer in bottoms for b in layer)
    kept_ids = {id(b) for b in kept}

    def links(end, nxt):
        if len(tops[end]) != 1 or len(bottoms[nxt]) != 1 or len(tops[nxt]) != 1 \
                or bottoms[nxt][0] is not tops[end][0] or any(loss_weights[nxt]):
            return False
        output = tops[end][0]
        if tops[nxt][0] is not output and (consumers[id(output)] > 1 or id(output) in kept_ids):
            return False
        if backward_flags is None:
            return True
        need, bottom_need = backward_flags
        return need[nxt] == need[end] and bottom_need[nxt] == [need[end]]

    chains, absorbed = [[] for _ in layers], set()
    for head, layer in enumerate(layers):
        if head in absorbed:
            continue
        end = head
        while end + 1 < len(layers) and links(end, end + 1) \
                and layer.absorb(layers[end + 1], tops[end + 1][0]):
            end += 1
            absorbed.add(end)
            chains[head].append(end)
        if end > head:
            output = tops[end][0]
            layer.output_survives = not any(output in t and output in b
                                            for t, b in zip(tops[end + 1:], bottoms[end + 1:]))
    return chains


class KeptBlobs(collections.OrderedDict):
    """A planned net's ``blobs``: the kept ones; asking for another names the remedy."""

    def __init__(self, items, dropped):
        super().__init__(items)
        self.dropped = set(dropped)

    def __missing__(self, name):
        if name in self.dropped:
            raise CaffeError("blob %s was not kept; pass keep=[%s] or memory_plan='off'"
                             % (quote(name), quote(name)))
        raise KeyError(name)
