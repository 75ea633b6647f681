"""Memory plans: storage shared by liveness, in a net that runs forward only and in one
that trains. Which plan a net takes, and how it runs under it, is the MemoryPlanner's
(memory_planner.py); this module lays the blobs out.

Blobs that alias one array (an in-place top, Split tops, Reshape and Flatten views) form
one group, live from the first layer that writes one of its blobs to the last layer that
reads or writes one. In a net that trains, layer i's forward is step i and its backward
step 2L - 1 - i of one timeline: a group's data lives on until the backward of the last
layer whose backward reads it (Layer.backward_reads), and a blob's diff lives from the
backward of its last consumer, which writes it, to the backward of its first producer,
which reads it last.

Every group takes a block of one arena. Groups whose lives overlap get blocks that do not;
a group that starts at step t shares bytes only with groups whose lives ended before t,
so no layer ever reads a bottom that its own top overwrote, nor a top diff its bottom
diff overwrote. The largest groups are placed first, each at the lowest offset free over
its whole life, which keeps the arena within a few percent of the most bytes live at one
step. Kept blobs (the net's inputs and outputs, and those the user
names) keep storage of their own; so do the diffs of loss tops, which hold the loss
weight from the forward on, and a diff that its last consumer does not write (no
backward, or propagate_down false), so that no backward reads another blob's gradient.

The arena is a plain ``empty`` array: nothing is resident until a layer writes it. A plan
holds while the shapes do; the planner applies it again when the input shapes change.
"""
import collections

import numpy as np

from .blob import address_of, out_of_memory, storage_of

#: every block starts at a multiple of this many bytes: aligned for vector loads on the
#: host and for CuPy's kernels
ALIGNMENT = 256


def new_buffer(xp, nbytes):
    """Storage for a plan's arena (the tests fill it with NaN bytes instead)."""
    return xp.empty(nbytes, np.uint8)


class MemoryPlan:
    """Planned groups (``forward_plan``, ``train_plan``) and, once ``apply``-ed, the
    arena they share."""

    def __init__(self, groups, forward_only):
        self.groups = sorted(groups, key=lambda g: g.first)
        self.forward_only = forward_only
        self.arena = None
        #: per layer index: the groups whose data its backward is the first to read again
        self.refills = collections.defaultdict(list)
        for group in self.groups:
            if group.forward_life is not None:
                self.refills[group.refill_before].append(group)

    def planned_bytes(self):
        """The bytes of the arena ``apply`` would make for the shapes the blobs have now."""
        return _place(self.groups)

    def apply(self, xp):
        """Give every group's owner a view of its block, as its data or its diff (the
        layers' reshape makes the aliases' views again); returns the arena's bytes."""
        nbytes = _place(self.groups)
        try:
            self.arena = new_buffer(xp, nbytes)
        except MemoryError:
            raise out_of_memory("the arena of the net's memory plan (the storage its blobs "
                                'share)', nbytes, on_host=xp is np) from None
        for group in self.groups:
            owner = group.owner
            block = self.arena[group.offset:group.offset + group.nbytes]
            group.view = block.view(owner.dtype).reshape(owner.shape)
            if group.is_diff:
                owner.diff = group.view
            elif group.forward_life is None:
                owner.data = group.view
        return self.arena.nbytes

    def enter_backward(self, group):
        """Move a recomputed group to the block of its second life (its producer then
        writes it again), its aliases with it."""
        _move(group.members, group.forward_life.view, group.view)

    def enter_forward(self):
        """Every recomputed group back in the block of its first life."""
        for groups in self.refills.values():
            for group in groups:
                _move(group.members, group.view, group.forward_life.view)

    def holds(self):
        """Whether every group still lives in the arena: a reshape to a new size gives a
        blob storage of its own (and drops its diff), and then the net plans again."""
        for group in self.groups:
            array = group.owner.diff_if_made if group.is_diff else group.owner.data
            if group.forward_life is None and (
                    array is None or storage_of(array) is not self.arena):
                return False
        return True


def _move(members, old, new):
    """Make the blobs that view ``old``'s block view ``new``'s."""
    start = address_of(old)
    for blob in members:
        if start <= address_of(blob.data) < start + old.nbytes:
            blob.data = new.reshape(blob.shape)


def forward_plan(bottoms, tops, kept):
    """The plan of a net that runs forward only: its blobs share storage by liveness.
    ``bottoms`` and ``tops`` are the net's per-layer lists of Blob; ``kept`` the blobs
    that keep their own storage."""
    return MemoryPlan(_data_groups(bottoms, tops, kept), forward_only=True)


def train_plan(bottoms, tops, backward_reads, runs_backward, writes_diff, kept_data, kept_diff,
               recomputable=(), rerunnable=()):
    """The plan of a net that runs backward, on one timeline: layer i's forward is step i,
    its backward step 2L - 1 - i. A blob's data lives on until the backward of the last
    layer that reads it (``backward_reads[i]``: the blobs layer i's backward reads);
    diffs as the module docstring says. ``runs_backward[i]`` and ``writes_diff[i][j]``:
    whether layer i's backward runs and writes the diff of its bottom j.

    ``recomputable``: the tops that their layer can write again from what it keeps
    (Layer.recomputable): such a group lives twice, in the forward until its last reader
    there, and again from the backward of the first layer to read it (``MemoryPlan.refills``).
    ``rerunnable``: {index: the indices of the layers it absorbed} of the layers that may
    run their forward again for the same purpose (Layer.rerunnable), from their bottoms,
    whose data must then live until that refill: each one's top does where that lowers the
    peak (``_choose_reruns``)."""
    steps = 2 * len(bottoms)
    reads = [blobs if runs else [] for blobs, runs in zip(backward_reads, runs_backward)]
    again = {id(blob) for blob in recomputable}

    def backward_steps(group):
        return [steps - 1 - i for i, blobs in enumerate(reads) if any(b in group for b in blobs)]

    groups, forward_last = [], {}
    for group in _data_groups(bottoms, tops, kept_data):
        later = backward_steps(group.members)
        if later and any(id(b) in again for b in group.members):
            groups += [group, _second_life(group, later, steps)]
        else:
            forward_last[group] = group.last
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
    if rerunnable:
        _choose_reruns(groups, forward_last, rerunnable, bottoms, tops, backward_steps)
    return MemoryPlan(groups, forward_only=False)


def _second_life(group, later, steps):
    """The life of ``group`` written again before the first backward that reads it (at the
    steps ``later``) and kept until the last."""
    return _Group(group.owner, min(later), max(later), members=group.members,
                  forward_life=group, refill_before=steps - 1 - min(later))


def _choose_reruns(groups, forward_last, rerunnable, bottoms, tops, backward_steps):
    """For each layer of ``rerunnable`` in turn whose one top a backward reads: let the top go
    after its last forward reader (``forward_last``) and have the layer write it again
    before the first backward reader, its bottoms' data living until then, if that lowers
    the most bytes live at one step (or, as high, holds them over fewer steps: another
    layer may lower the others). Adds the second lives to ``groups`` (their ``rerun``: the
    layer). A bottom must be as the layer read it: one that lives twice, or that a later
    layer writes in place, rules the layer out."""
    by_blob = {id(b): g for g in groups if not g.is_diff for b in g.members}
    aliases = _alias_sets(bottoms, tops)
    writers = collections.defaultdict(set)
    for i, layer_tops in enumerate(tops):
        for top in layer_tops:
            writers[id(aliases[id(top)][0])].add(i)
    twice = {id(g.forward_life) for g in groups if g.forward_life is not None}
    live = _live_bytes(groups, 2 * len(tops))
    for i, chain in sorted(rerunnable.items()):
        written = _unique(tops[i])
        group = by_blob.get(id(written[0])) if len(written) == 1 else None
        if group is None or id(group) in twice or \
                writers[id(group.members[0])] - set(chain) != {i}:
            continue                   # kept, already written again, or written in place
        later = backward_steps(group.members)
        sources = {id(by_blob[id(b)]): by_blob[id(b)] for b in bottoms[i] if id(b) in by_blob}
        if not later or any(id(g) in twice for g in sources.values()) or any(
                max(writers[id(aliases[id(b)][0])], default=i) > i for b in bottoms[i]):
            continue
        second = _second_life(group, later, 2 * len(tops))
        trial = live.copy()
        trial[forward_last[group] + 1:second.first] -= group.owner.data.nbytes
        for g in sources.values():
            trial[g.last + 1:second.first + 1] += g.owner.data.nbytes
        if _peak(trial) < _peak(live):
            live, second.rerun = trial, i
            group.last = forward_last[group]
            for g in sources.values():
                g.last = max(g.last, second.first)
            groups.append(second)
            twice.add(id(group))


def _live_bytes(groups, steps):
    """Per step, the bytes of the groups alive then."""
    change = np.zeros(steps + 1, np.int64)
    for group in groups:
        change[group.first] += group.owner.data.nbytes
        change[group.last + 1] -= group.owner.data.nbytes
    return np.cumsum(change)[:steps]


def _peak(live):
    """The most bytes live at one step, and over how many steps: smaller is better."""
    most = int(live.max(initial=0))
    return most, int((live == most).sum())


def _data_groups(bottoms, tops, kept):
    """A _Group per set of blobs that alias one array (in place, Split, views), live from
    the first layer that writes one to the last that reads one; kept groups, inputs and
    views of a layer's own array keep their own storage."""
    kept_ids = {id(b) for b in kept}
    groups = []
    for group in _unique_lists(_alias_sets(bottoms, tops).values()):
        writes = [i for i, layer in enumerate(tops) if any(t in group for t in layer)]
        uses = writes + [i for i, layer in enumerate(bottoms) if any(b in group for b in layer)]
        if not writes or any(id(b) in kept_ids for b in group):
            continue                   # an input, or kept: storage of its own
        owner = next(b for i in sorted(writes) for b in tops[i] if b in group)
        if storage_of(owner.data) is not owner.data:
            continue                   # a view of a layer's own array (Parameter's top)
        groups.append(_Group(owner, min(writes), max(uses), members=group))
    return groups


def _alias_sets(bottoms, tops):
    """Per blob (by id): the list of the blobs that alias its array (in place, Split,
    views), one list shared by all of them, in the order the net first names them."""
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
    return {id(b): members[root(id(b))] for b in blobs}


def _place(groups):
    """Lay ``groups`` out in one arena, sized for the shapes their blobs have now: largest
    first, each at the lowest aligned offset where no group placed before it whose life
    overlaps its own lies. Sets each group's ``offset`` and ``nbytes``; returns the
    arena's bytes."""
    for group in groups:
        group.nbytes = group.owner.data.nbytes      # not its storage's: that is the arena
    placed, end = [], 0
    for group in sorted(groups, key=lambda g: (-g.nbytes, g.first)):
        offset = 0
        for start, stop in sorted((g.offset, g.offset + g.nbytes) for g in placed
                                  if g.first <= group.last and group.first <= g.last):
            if start >= offset + group.nbytes:
                break
            offset = max(offset, -(-stop // ALIGNMENT) * ALIGNMENT)
        group.offset = offset
        placed.append(group)
        end = max(end, offset + group.nbytes)
    return end


class _Group:
    """What one block of the arena holds for a while: ``owner``'s data (and its aliases',
    ``members``), or its diff (``is_diff``), live over the steps [first, last]. A
    recomputed group's second life names its first (``forward_life``) and the layer
    before whose backward it is written again (``refill_before``)."""

    def __init__(self, owner, first, last, is_diff=False, members=(), forward_life=None,
                 refill_before=None):
        self.owner, self.first, self.last, self.is_diff = owner, first, last, is_diff
        self.members = list(members) or [owner]
        self.forward_life, self.refill_before = forward_life, refill_before
        #: the layer that runs its forward again to write a second life (None: the
        #: layer that wrote the group recomputes it, Layer.recompute)
        self.rerun = None
        self.nbytes = self.offset = self.view = None


def _unique_lists(lists):
    seen, out = set(), []
    for members in lists:
        if id(members) not in seen:
            seen.add(id(members))
            out.append(members)
    return out


def _unique(blobs):
    seen, out = set(), []
    for blob in blobs:
        if id(blob) not in seen:
            seen.add(id(blob))
            out.append(blob)
    return out
