"""The memory plans a Net may take, and the MemoryPlanner that makes and runs its plan.

A Net owns one MemoryPlanner, made once its layers and blobs are; the planner reads the
net through a NetWiring and nothing else. It knows what the plans are (``PLANS``) and the
two defaults (``DEFAULT_PLAN``); lets layers absorb the chains that follow them; chooses
for 'auto'; lays the blobs out in one arena (memory_plan.py), again when the input shapes
change; writes again, before a layer's backward, the tops the plan let go; and refuses a
partial pycaffe pass that would read what the plan shared. Of the layers it asks only what
layer.py's section "What the Net asks" lists.
"""
import collections
import logging

from .blob import format_bytes, storage_of
from .caffe_pb2 import TEST
from .errors import CaffeError, name_list, quote
from .memory_plan import forward_plan, train_plan

log = logging.getLogger('caffe_syncbn')

#: 'auto' takes 'recompute' where its arena comes to at most this fraction of
#: 'inplace_abn''s: each recomputed top costs one more pass, which a small saving does
#: not repay
AUTO_SAVING = 0.9

#: the plans and what each does, as -memory_plan's help says it (docs/pycaffe-and-cli.md,
#: Memory, says it at length)
PLANS = collections.OrderedDict([
    ('off', 'every blob keeps its own, as in Caffe'),
    ('share', "storage shared by liveness, the blobs' of a net that runs forward only, the "
              "diffs' of one that trains"),
    ('inplace_abn', 'share, and batch norms run the Scale and ReLU after them and keep only '
                    'their output'),
    ('recompute', 'inplace_abn, and outputs written again for the backward'),
    ('auto', 'recompute where it saves at least %d%% of the memory, else inplace_abn'
             % round(100 * (1 - AUTO_SAVING))),
])
MEMORY_PLANS = tuple(PLANS)

#: the plan where the caller names none: pycaffe's Net and solvers keep every blob, as
#: pycaffe's do, since a script may read any of them; the caffe-syncbn commands read
#: only the outputs, and save what they can
DEFAULT_PLAN = {'pycaffe': 'off', 'command': 'auto'}


def check_plan(name, source=None):
    """``name`` if it is one of PLANS, else the one-line error (naming ``source``, the file
    that named it, if it was a file)."""
    if name not in PLANS:
        raise CaffeError('%smemory_plan %s: expected one of %s'
                         % (source + ': ' if source else '', quote(name), ', '.join(PLANS)))
    return name


def describe_plans(default, note='the default'):
    """Each plan and what it does, ``default`` marked with ``note``: -memory_plan's help."""
    return '; '.join('%s%s: %s' % (name, ' (%s)' % note if name == default else '', text)
                     for name, text in PLANS.items())


#: what the planner reads of a net, fixed once the net is built: its NetParameter (layer
#: i's is ``param.layer[i]``), phase and array module; per layer, the Layer, its bottom
#: and top Blobs, loss weights and Caffe's backward flags (whether it runs backward, and
#: per bottom whether it writes that diff); the blobs by name, the inputs and outputs
NetWiring = collections.namedtuple(
    'NetWiring', 'param phase xp layers bottoms tops loss_weights need_backward '
                 'bottom_need_backward blobs inputs outputs')


class MemoryPlanner:
    """How a Net takes memory under ``plan`` (one of PLANS), given its NetWiring and the
    blob names to ``keep`` whatever the plan. The Net asks it before each forward
    (``before_forward``), before a backward (``check_backward``) and each layer's
    (``before_backward``), and before a partial pass (``check_pass``); it skips the
    layers of ``absorbed``, which their head runs with it.

    chosen:      the plan the net takes ('auto' names its choice)
    plan:        the MemoryPlan (memory_plan.py), None under 'off'
    kept:        the names of the blobs the net shows (``shown_blobs``)
    chains:      per layer, the indices of the layers it absorbed (Layer.absorb)
    absorbed:    the indices of every absorbed layer
    recomputers: {id(top): the layer that writes that top again} (Layer.recomputable)
    """

    def __init__(self, plan, wiring, keep=()):
        self.wiring = wiring
        self.chosen = check_plan(plan)
        self.plan = None
        self.chains = [[] for _ in wiring.layers]
        self.absorbed = set()
        self.recomputers = {}
        self.kept = set(wiring.blobs)
        if plan != 'off':
            self._make(plan, list(keep))

    @property
    def forward_only(self):
        """Whether the plan shares the blobs a backward would read (a TEST net without
        force_backward)."""
        return self.plan is not None and self.plan.forward_only

    def shown_blobs(self):
        """What the net shows as ``blobs``: every blob, or under a plan the kept ones."""
        blobs = self.wiring.blobs
        if self.plan is None:
            return blobs
        return KeptBlobs([(name, blob) for name, blob in blobs.items() if name in self.kept],
                         [name for name in blobs if name not in self.kept])

    # ---- making the plan ---------------------------------------------------------------
    def _make(self, plan, keep):
        wiring = self.wiring
        unknown = [name for name in keep if name not in wiring.blobs]
        if unknown:
            raise CaffeError("keep: net '%s' has no blob %s"
                             % (wiring.param.name, quote(unknown[0])))
        self.kept = set(wiring.inputs) | set(wiring.outputs) | set(keep)
        kept = [wiring.blobs[name] for name in self.kept]
        forward_only = wiring.phase == TEST and not wiring.param.force_backward
        if forward_only:
            for layer in wiring.layers:          # nothing need be kept for a backward
                layer.backward_runs = False
        if plan in ('inplace_abn', 'recompute', 'auto'):
            self.chains = absorb_chains(
                wiring.layers, wiring.bottoms, wiring.tops, wiring.loss_weights,
                None if forward_only else (wiring.need_backward, wiring.bottom_need_backward),
                kept)
            self.absorbed = {k for chain in self.chains for k in chain}
        persistent = [top for layer, tops in zip(wiring.layers, wiring.tops)
                      if layer.tops_persist for top in tops]
        kept_data = kept + persistent
        # a chain's head writes its output in the forward and reads its diff in the backward
        tops = [t + [wiring.tops[k][0] for k in chain]
                for t, chain in zip(wiring.tops, self.chains)]
        if forward_only:
            self.plan = forward_plan(wiring.bottoms, tops, kept_data)
            self.chosen = 'inplace_abn' if plan == 'auto' else plan
        else:
            self.plan = self._train_plan(plan, tops, kept_data)
        self._apply()

    def _train_plan(self, plan, tops, kept_data):
        """The plan of a net that runs backward; 'auto' takes 'recompute' where it saves
        enough (AUTO_SAVING), else 'inplace_abn'."""
        wiring = self.wiring
        runs = [need and i not in self.absorbed for i, need in enumerate(wiring.need_backward)]
        reads = [layer.backward_reads(bottoms, layer_tops) for layer, bottoms, layer_tops
                 in zip(wiring.layers, wiring.bottoms, wiring.tops)]
        loss_tops = [top for layer_tops, weights in zip(wiring.tops, wiring.loss_weights)
                     for top, weight in zip(layer_tops, weights) if weight]
        kept_diff = kept_data + loss_tops

        def planned(recompute):
            rerunnable = {i: chain for i, (layer, chain) in
                          enumerate(zip(wiring.layers, self.chains))
                          if recompute and i not in self.absorbed and layer.rerunnable()}
            return train_plan(wiring.bottoms, tops, reads, runs, wiring.bottom_need_backward,
                              kept_data, kept_diff, [b for t in tops for b in t if recompute
                                                     and id(b) in recomputers], rerunnable)

        recomputers = {id(top): layer for i, (layer, bottoms, layer_tops) in
                       enumerate(zip(wiring.layers, wiring.bottoms, wiring.tops))
                       if runs[i] for top in layer.recomputable(bottoms, layer_tops)}
        if plan != 'auto':
            self.recomputers = recomputers if plan == 'recompute' else {}
            return planned(plan == 'recompute')
        lean, full = planned(False), planned(True)
        lean_bytes, full_bytes = lean.planned_bytes(), full.planned_bytes()
        self.chosen = 'recompute' if full_bytes <= AUTO_SAVING * lean_bytes else 'inplace_abn'
        log.info("Net '%s': memory plan %s (an arena of %s; recompute %s, inplace_abn %s)",
                 wiring.param.name, self.chosen, format_bytes(min(full_bytes, lean_bytes)),
                 format_bytes(full_bytes), format_bytes(lean_bytes))
        if self.chosen == 'recompute':
            self.recomputers = recomputers
            return full
        return lean

    def _apply(self):
        self._reshape()                        # sized for the inputs as they are now
        planned = self.plan.apply(self.wiring.xp)
        self._reshape()                        # the aliases take views of the new storage
        self._planned_inputs = self._input_shapes()
        log.debug("Net '%s': %d planned groups share %s", self.wiring.param.name,
                  len(self.plan.groups), format_bytes(planned))

    def _reshape(self):
        wiring = self.wiring
        for layer, bottoms, tops in zip(wiring.layers, wiring.bottoms, wiring.tops):
            layer.reshape(bottoms, tops)

    def _input_shapes(self):
        return [self.wiring.blobs[name].shape for name in self.wiring.inputs]

    # ---- what the Net asks -------------------------------------------------------------
    def before_forward(self, start):
        """Before a forward from layer ``start``: recomputed blobs back in the blocks of
        their first life, and the plan made again for new input shapes. A pass that goes on
        from a later layer (as per-layer timing runs one) is checked where it started, from
        layer 0."""
        if self.plan is None:
            return
        self.plan.enter_forward()
        if self._input_shapes() != self._planned_inputs or (
                start == 0 and not self.plan.holds()):
            self._apply()

    def check_backward(self):
        """Refuse a backward where the plan shares what it would read."""
        if self.forward_only:
            raise CaffeError("net '%s' runs forward only: its memory plan shares the blobs a "
                             "backward would read; build it with memory_plan='off'"
                             % self.wiring.param.name)

    def before_backward(self, i):
        """Before layer i's backward: write again the blobs the plan let go that it is the
        first backward to read, by the layer that wrote them (Layer.recompute) or by
        running a layer's forward again (Layer.rerunnable)."""
        if self.plan is None:
            return
        wiring = self.wiring
        for group in self.plan.refills.get(i, ()):
            self.plan.enter_backward(group)
            if group.rerun is not None:
                k = group.rerun
                wiring.layers[k].forward(wiring.bottoms[k], wiring.tops[k])
                continue
            for blob in group.members:
                if id(blob) in self.recomputers:
                    self.recomputers[id(blob)].recompute(blob)

    def check_pass(self, start, end, backward):
        """A pycaffe pass over layers [start, end] (backward: from start down to end) under a
        plan: it must not cut a chain that one layer runs, nor read a blob (in the forward)
        or a diff (in the backward) that a part of the net outside the pass wrote into
        shared storage, nor read a blob that recompute writes again outside the pass. A
        pass over the whole net, and a backward that check_backward refuses, pass."""
        last_layer = len(self.wiring.layers) - 1
        whole = (last_layer, 0) if backward else (0, last_layer)
        if self.plan is None or (start, end) == whole or (backward and self.forward_only):
            return
        wiring, first, last = self.wiring, min(start, end), max(start, end)
        names = [lp.name for lp in wiring.param.layer]
        for head, chain in enumerate(self.chains):
            if chain and head <= last and first <= chain[-1] \
                    and not first <= head <= chain[-1] <= last:
                raise CaffeError("layer %s runs %s with it under memory_plan '%s': start "
                                 "and end the pass outside that chain, or pass "
                                 "memory_plan='off'" % (quote(names[head]), name_list(
                                     [names[k] for k in chain]), self.chosen))
        arena = self.plan.arena
        passed = range(first, last + 1)
        if not backward:
            outside = {id(top) for tops in wiring.tops[:first] for top in tops}
            for i in passed:
                for j, blob in enumerate(wiring.bottoms[i]):
                    if id(blob) in outside and storage_of(blob.data) is arena:
                        self._not_kept(i, 'blob', wiring.param.layer[i].bottom[j])
            return
        steps = 2 * len(wiring.layers)
        for i, groups in self.plan.refills.items():
            if i > last and any(steps - 1 - g.last <= last for g in groups):
                raise CaffeError("layer %s writes again, before its backward, a blob the "
                                 "backward of layers up to %s reads under memory_plan "
                                 "'recompute'; start the pass there or pass memory_plan='off'"
                                 % (quote(names[i]), quote(names[last])))
        later = {id(bottom) for bottoms in wiring.bottoms[last + 1:] for bottom in bottoms}
        for i in reversed(passed):
            for j, blob in enumerate(wiring.tops[i]):
                if id(blob) in later and blob.diff_if_made is not None and \
                        storage_of(blob.diff_if_made) is arena:
                    self._not_kept(i, 'the diff of blob', wiring.param.layer[i].top[j])

    def _not_kept(self, i, what, name):
        """Layer i needs the shared blob ``name``, said as the prototxt names it (a Split's
        top by the blob it splits)."""
        layers = self.wiring.param.layer
        splits = {top: lp.bottom[0] for lp in layers if lp.type == 'Split' for top in lp.top}
        while name in splits:
            name = splits[name]
        raise CaffeError("layer %s reads %s %s, which the memory plan shares and a part of "
                         "the net outside this pass writes; pass keep=[%s] or memory_plan='off'"
                         % (quote(layers[i].name), what, quote(name), quote(name)))


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
