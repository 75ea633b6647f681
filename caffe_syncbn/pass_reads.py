"""What a Net's pass reads of its device: on a GPU each read waits for the device's queue,
so a pass reads twice at most, whatever its depth. Before it, what the layers decide the
pass by (Layer.before_pass), all at once; after it, the loss with every check and value the
layers left for it (LayerContext.check_later, read_later)."""
import numpy as np

from .backend import to_numpy


def decide_before_pass(layers, xp):
    """Hand each of ``layers`` the host copy of what its ``before_pass`` asks, in one read."""
    asked = [(layer, layer.before_pass()) for layer in layers]
    asked = [(layer, values) for layer, values in asked if values is not None]
    if not asked:
        return
    host = to_numpy(xp.concatenate([values for _, values in asked]))
    offset = 0
    for layer, values in asked:
        layer.decided(host[offset:offset + values.size])
        offset += values.size


def read_pass(context, loss):
    """The pass's loss as a float, its layers' checks and the values they read later
    (LayerContext.read_later), in one read of the device; hands those values over, then
    raises the first check that failed."""
    checks, reads = context.pending_checks, context.pending_reads
    if not checks and not reads and isinstance(loss, float):     # numpy's float64 is a float
        return float(loss)
    xp = context.xp
    values = to_numpy(xp.stack([xp.asarray(loss, dtype=np.float64)] +
                               [failed.astype(np.float64) for failed, _, _ in checks] +
                               [value.astype(np.float64) for value, _ in reads]))
    context.pending_checks, context.pending_reads = [], []
    for (_, receive), value in zip(reads, values[1 + len(checks):]):
        receive(value)
    for (_, layer, message), failed in zip(checks, values[1:]):
        if failed:
            raise layer.error(message())
    return float(values[0])
