"""Which blobs of a Net take the half ``activation_dtype`` under mixed precision.

Half precision starts at the learned layers and flows down the net: a top takes its
layer's first bottom's dtype, and a layer with learnable blobs (a convolution, a batch
norm) makes its tops half. What half precision would spoil stays in the full dtype: the
tops of layers without bottoms (inputs, labels, boxes: exact as float32, and a small part
of the memory), tops with a loss weight (a sum over a batch overflows float16), the tops a
layer says hold exact values (Layer.full_precision_top: indices, accuracies), and what
is computed from them alone (a Split or Reshape of the labels). A top written in place is
its bottom's blob and keeps its dtype. Under one precision every blob has ``ctx.dtype``.
"""
from .blob import Blob


def new_top(ctx, layer, index, bottoms, loss_weight):
    """A new top blob for ``layer``'s top ``index``, in the dtype it has before the layer's
    setup (``retype_learned_tops`` may change it after)."""
    if ctx.activation_dtype == ctx.dtype or not bottoms or loss_weight or \
            layer.full_precision_top(index):
        return Blob((), ctx.dtype, ctx.xp)
    return Blob((), bottoms[0].dtype, ctx.xp)


def retype_learned_tops(ctx, layer, new_tops, loss_weights):
    """After ``layer``'s setup: its new tops take the activation dtype if it learns (has
    blobs) and none of the rules above keeps them full."""
    if ctx.activation_dtype == ctx.dtype or not layer.blobs or not layer.param.bottom:
        return
    for index, blob in new_tops:
        if not loss_weights[index] and not layer.full_precision_top(index):
            blob.retype(ctx.activation_dtype)
