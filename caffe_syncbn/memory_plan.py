"""Memory plans: storage shared by liveness, in a net that runs forward only and in one
that trains.

Blobs that alias one array (an in-place top, Split tops, Reshape and Flatten views) form
one group, live from the first layer that writes one of its blobs to the last layer that
reads or writes one. In a net that trains, layer i's forward is step i and its backward
step 2L - 1 - i of one timeline: a group's data lives on until the backward of the last
layer whose backward reads it (Layer.backward_reads), and a blob's diff lives from the
backward of its last consumer, which writes it, to the backward of its first producer,
which reads it last.

Groups whose lives do not overlap take turns in one buffer, sized for the largest; a
group that starts at step t reuses a buffer only when its previous occupant's life ended
before t, so no layer ever reads a bottom that its own top overwrote, nor a top diff its
bottom diff overwrote. Kept blobs (the net's inputs and outputs, and those the user
names) keep storage of their own; so do the diffs of loss tops, which hold the loss
weight from the forward on, and a diff that its last consumer does not write (no
backward, or propagate_down false), so that no backward reads another blob's gradient.

Buffers are plain ``empty`` arrays: nothing is resident until a layer writes it. A plan
holds while the shapes do; the Net plans again when its input shapes change.
"""
import collections

import numpy as np

from .blob import storage_of
from .errors import CaffeError, quote

#: the memory plans a Net takes: 'off' keeps every blob (pycaffe's Net); 'share' shares
#: the blobs of a net that runs forward only, and the diffs of one that runs backward;
#: 'inplace_abn' shares as 'share' does, and lets layers absorb the chains that follow
#: them (Layer.absorb: batch norm with its Scale and ReLU); 'recompute' is 'inplace_abn'
#: whose layers write again in the backward the tops they can (Layer.recomputable)
MEMORY_PLANS = ('off', 'share', 'inplace_abn', 'recompute')


def new_buffer(xp, nbytes):
    """Storage for one planned buffer (the tests fill it with NaN bytes instead)."""
    return xp.empty(nbytes, np.uint8)


class MemoryPlan:
    """Planned groups (``forward_plan``, ``train_plan``) and, once ``apply``-ed, the
    buffers they share."""

    def __init__(self, groups, forward_only):
        self.groups = sorted(groups, key=lambda g: g.first)
        self.forward_only = forward_only
        self.buffers = []
        #: per layer index: the groups whose data its backward is the first to read again
        self.refills = collections.defaultdict(list)
        for group in self.groups:
            if group.forward_life is not None:
                self.refills[group.refill_before].append(group)

    def apply(self, xp):
        """Give every group's owner a view of its buffer, as its data or its diff (the
        layers' reshape makes the aliases' views again); returns the bytes of all buffers."""
        for group in self.groups:           # sized for the shapes the blobs have now
            group.nbytes = storage_of(group.owner.data).nbytes
        self.buffers = _share_buffers(xp, self.groups)
        for group in self.groups:
            owner = group.owner
            group.view = self.buffers[group.buffer][:group.nbytes].view(owner.dtype).reshape(
                owner.shape)
            if group.is_diff:
                owner.diff = group.view
            elif group.forward_life is None:
                owner.data = group.view
        return sum(buffer.nbytes for buffer in self.buffers)

    def enter_backward(self, group):
        """Move a recomputed group to its backward buffer (its producer then writes it
        again), its aliases with it."""
        _move(group.members, group.forward_life.view, group.view)

    def enter_forward(self):
        """Every recomputed group back in its forward buffer."""
        for groups in self.refills.values():
            for group in groups:
                _move(group.members, group.view, group.forward_life.view)

    def holds(self):
        """Whether every group still lives in its buffer: a reshape to a new size gives a
        blob storage of its own (and drops its diff), and then the net plans again."""
        for group in self.groups:
            array = group.owner.diff_if_made if group.is_diff else group.owner.data
            if group.forward_life is None and (
                    array is None or storage_of(array) is not self.buffers[group.buffer]):
                return False
        return True


def _move(members, old, new):
    """Make the blobs that view ``old``'s storage view ``new``'s."""
    for blob in members:
        if storage_of(blob.data) is storage_of(old):
            blob.data = new.reshape(blob.shape)


def forward_plan(bottoms, tops, kept):
    """The plan of a net that runs forward only: its blobs share storage by liveness.
    ``bottoms`` and ``tops`` are the net's per-layer lists of Blob; ``kept`` the blobs
    that keep their own storage."""
    return MemoryPlan(_data_groups(bottoms, tops, kept), forward_only=True)


def train_plan(bottoms, tops, backward_reads, runs_backward, writes_diff, kept_data, kept_diff,
               recomputable=()):
    """The plan of a net that runs backward, on one timeline: layer i's forward is step i,
    its backward step 2L - 1 - i. A blob's data lives on until the backward of the last
    layer that reads it (``backward_reads[i]``: the blobs layer i's backward reads);
    diffs as the module docstring says. ``runs_backward[i]`` and ``writes_diff[i][j]``:
    whether layer i's backward runs and writes the diff of its bottom j.
    ``recomputable``: the tops that their layer can write again (Layer.recomputable): such
    a group lives twice, in the forward until its last reader there, and again from the
    backward of the first layer to read it (``MemoryPlan.refills``)."""
    steps = 2 * len(bottoms)
    reads = [blobs if runs else [] for blobs, runs in zip(backward_reads, runs_backward)]
    again = {id(blob) for blob in recomputable}

    def backward_steps(group):
        return [steps - 1 - i for i, blobs in enumerate(reads) if any(b in group for b in blobs)]

    groups = []
    for group in _data_groups(bottoms, tops, kept_data):
        later = backward_steps(group.members)
        if later and any(id(b) in again for b in group.members):
            groups += [group, _Group(group.owner, min(later), max(later), members=group.members,
                                     forward_life=group, refill_before=steps - 1 - min(later))]
        else:
            group.last = max([group.last] + later)
            groups.append(group)
    kept_ids = {id(b) for b in kept_diff}
    for blob in _unique([b for layer in bottoms for b in layer]):
        if id(blob) in kept_ids:
            continue
        consumers = [i for i, layer in enumerate(bottoms) if any(b is blob for b in layer)]
        producers = [i for i, layer in enumerate(tops) if any(t is blob for t in layer)]
        last = max(consumers)
        j = next(j for j, b in enumerate(bottoms[last]) if b is blob)
        if producers and runs_backward[last] and writes_diff[last][j]:
            groups.append(_Group(blob, steps - 1 - last, steps - 1 - min(producers), True))
    return MemoryPlan(groups, forward_only=False)


def _data_groups(bottoms, tops, kept):
    """A _Group per set of blobs that alias one array (in place, Split, views), live from
    the first layer that writes one to the last that reads one; kept groups, inputs and
    views of a layer's own array keep their own storage."""
    blobs = _unique([b for layer in bottoms + tops for b in layer])
    parent = {id(b): id(b) for b in blobs}

    def root(key):
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for layer_bottoms, layer_tops in zip(bottoms, tops):
        for top in layer_tops:
            for bottom in layer_bottoms:
                if top is bottom or storage_of(top.data) is storage_of(bottom.data):
                    parent[root(id(top))] = root(id(bottom))
    members = {}
    for blob in blobs:
        members.setdefault(root(id(blob)), []).append(blob)
    kept_ids = {id(b) for b in kept}
    groups = []
    for group in members.values():
        writes = [i for i, layer in enumerate(tops) if any(t in group for t in layer)]
        uses = writes + [i for i, layer in enumerate(bottoms) if any(b in group for b in layer)]
        if not writes or any(id(b) in kept_ids for b in group):
            continue                   # an input, or kept: storage of its own
        owner = next(b for i in sorted(writes) for b in tops[i] if b in group)
        if storage_of(owner.data) is not owner.data:
            continue                   # a view of a layer's own array (Parameter's top)
        groups.append(_Group(owner, min(writes), max(uses), members=group))
    return groups


def _share_buffers(xp, groups):
    """Buffers for ``groups`` (sorted by ``first``): a group takes a buffer whose last
    occupant's life ended before its own began, the smallest that fits, else the largest
    free one grown to fit, else a new one. Sets each group's ``buffer``."""
    sizes, free_after = [], []             # per buffer: bytes, last layer of its occupant
    for group in groups:
        free = [k for k, last in enumerate(free_after) if last < group.first]
        fits = [k for k in free if sizes[k] >= group.nbytes]
        if fits:
            k = min(fits, key=lambda k: sizes[k])
        elif free:
            k = max(free, key=lambda k: sizes[k])
            sizes[k] = group.nbytes
        else:
            k = len(sizes)
            sizes.append(group.nbytes)
            free_after.append(None)
        group.buffer = k
        free_after[k] = group.last
    return [new_buffer(xp, size) for size in sizes]


class _Group:
    """What one buffer holds for a while: ``owner``'s data (and its aliases', ``members``),
    or its diff (``is_diff``), live over the steps [first, last]. A recomputed group's
    second life names its first (``forward_life``) and the layer before whose backward
    it is written again (``refill_before``)."""

    def __init__(self, owner, first, last, is_diff=False, members=(), forward_life=None,
                 refill_before=None):
        self.owner, self.first, self.last, self.is_diff = owner, first, last, is_diff
        self.members = list(members) or [owner]
        self.forward_life, self.refill_before = forward_life, refill_before
        self.nbytes = self.buffer = self.view = None


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


def _unique(blobs):
    seen, out = set(), []
    for blob in blobs:
        if id(blob) not in seen:
            seen.add(id(blob))
            out.append(blob)
    return out
