"""The BN of SegNet's and ENet's Caffe (alexgkendall/caffe-segnet, TimoSaemann/caffe-enet),
which shares its type name with PSPNet's BN: the settings tell them apart
(syncbn_policy.is_segnet_bn), and this class is built for a BN that names SegNet's.

Blobs: scale and shift, each 1xCx1x1, from scale_filler and shift_filler; no running
statistics. ``bn_mode``:

* LEARN (the default): y = scale * (x - mean) / sqrt(var + 1e-9) + shift with the mean
  and biased variance of the batch, in TRAIN and TEST alike, and the true gradient of
  that. Up to two more tops get the batch mean and variance (1xCx1x1), which SegNet's
  compute_bn_statistics script averages over a data set; their diffs pass back into dx as
  the gradient has it, where the forks drop them (no loss reads them in the forks' nets).
* INFERENCE: y = scale * x + shift, the statistics folded into scale and shift by that
  script; dscale = sum(dy * x), dshift = sum(dy), dx = scale * dy.

The forks' backward overwrites the param diffs where every Caffe layer adds to them; here
they add, so iter_size and shared params see the true gradient. Under -sync_bn the layer
becomes a SyncBN with the same settings (SyncSegNetBN): LEARN takes the statistics of the
global batch, one allreduce forward and one backward (two with the statistics tops, whose
diffs add up over the replicas), as SyncBN does, with the sums taken about 0 (no running
mean is there to share as a reference).
"""
from ...layer import register_variant
from ...syncbn_policy import is_segnet_bn
from .array import STAT, channel_view, inverse_std
from .batch_norm import ChannelNorm
from .chain import Chain

#: the variance epsilon both forks fix
SEGNET_EPS = 1e-9


@register_variant('BN', is_segnet_bn)
class SegNetBN(ChannelNorm):
    """SegNet's and ENet's BN (module docstring)."""

    SCALE, SHIFT = range(2)

    def setup(self, bottom, top):
        p = self.param.bn_param
        self.inference = p.bn_mode == p.INFERENCE
        if self.inference and len(top) > 1:
            raise self.error('bn_mode INFERENCE has one top, got %d: the batch mean and variance '
                             'tops are bn_mode LEARN\'s' % len(top))
        self.setup_channels(bottom, top, most_tops=3)
        self.eps = SEGNET_EPS
        shape = (1, self.channels, 1, 1)
        self.blobs = [self.make_blob(shape, p.scale_filler), self.make_blob(shape, p.shift_filler)]
        self.param_propagate_down = [True, True]
        self.extra_tops = len(top) - 1

    def reshape(self, bottom, top):
        super().reshape(bottom[:1], top[:1])
        for blob in top[1:]:
            blob.reshape((1, self.channels, 1, 1))

    def uses_batch_formula(self):
        return not self.inference

    def affine(self):
        return self.stat(self.SCALE), self.stat(self.SHIFT)

    def new_chain(self):
        return Chain(affine_owner=self, beta_index=self.SHIFT)

    def absorb(self, layer, top):
        # the statistics tops are written by the forward itself, not by a chain
        return not self.extra_tops and super().absorb(layer, top)

    def batch_reference(self):
        """What the batch sums are taken about (None: each batch's own mean)."""
        return None

    def forward(self, bottom, top):
        x3 = channel_view(bottom[0].data)
        xp = self.xp
        if self.inference:
            self._count = xp.full(1, x3.shape[0] * x3.shape[2], STAT)
            mean, self._inv_std = xp.zeros(self.channels, STAT), xp.ones(self.channels, STAT)
        else:
            self._count, mean, var = self.local_moments(x3, self.batch_reference())
            self._inv_std = inverse_std(var, self.eps)
            for blob, values in zip(top[1:], (mean, var)):
                blob.data[...] = values.reshape(blob.shape).astype(self.dtype)
        self.normalize(bottom, top[:1], mean, True, *self.affine())

    def backward(self, top, propagate_down, bottom):
        if self.chain is not None:
            return self.chain_backward(propagate_down, bottom)
        dy3, dx3 = channel_view(top[0].diff), channel_view(bottom[0].diff)
        sum_dy, sum_dy_x_hat = self.engine.gradient_sums(dy3, self._x_hat)
        if self.wants_param_gradient(self.SCALE):
            self.add_param_gradient(self.SCALE, sum_dy_x_hat)
        if self.wants_param_gradient(self.SHIFT):
            self.add_param_gradient(self.SHIFT, sum_dy)
        if not propagate_down[0]:
            return
        scale = self.stat(self.SCALE) * self._inv_std
        sums = self.batch_gradient_sums(sum_dy, sum_dy_x_hat)
        if sums is None:
            self.engine.input_gradient(dx3, dy3, scale)
        else:
            self.engine.input_gradient(dx3, dy3, scale, self._x_hat, *sums, count=self._count)
        if self.extra_tops and not self.inference:
            self.add_statistics_gradient(dx3, self.shared_statistics_diff(top[1:]))

    def shared_statistics_diff(self, statistics_tops):
        """The diffs of the mean and variance tops, (2, C), the variance's 0 without its top."""
        diff = self.xp.zeros((2, self.channels), STAT)
        for row, blob in zip(diff, statistics_tops):
            row[...] = blob.diff.reshape(-1)
        return diff

    def add_statistics_gradient(self, dx3, statistics_diff):
        # over the M values of a channel, d mean / dx = 1 / M and
        # d var / dx = 2 x_hat / (inv_std M): the engine's input gradient of a zero top diff at unit scale with these sums, which
        # finds x_hat wherever its engine keeps it
        d_mean, d_var = statistics_diff
        xp = self.xp
        through_statistics = xp.empty_like(dx3)
        self.engine.input_gradient(through_statistics, xp.zeros_like(dx3),
                                   xp.ones(self.channels, STAT), self._x_hat, -d_mean,
                                   -2 * d_var / self._inv_std, count=self._count)
        dx3 += through_statistics


@register_variant('SyncBN', is_segnet_bn)
class SyncSegNetBN(SegNetBN):
    """SegNet's BN over the batch of the replicas ``ctx.group_comm`` joins (-sync_bn: every
    replica, or the layer's group of them under sync_bn_group_size)."""

    synchronized = True

    def batch_reference(self):
        # every replica's sums about the same point, so that they add up
        return self.xp.zeros(self.channels, STAT)

    def batch_gradient_sums(self, sum_dy, sum_dy_x_hat):
        if self.inference:
            return None
        packed = self.xp.concatenate([sum_dy, sum_dy_x_hat])
        self.share(packed)
        return packed[:self.channels], packed[self.channels:]

    def shared_statistics_diff(self, statistics_tops):
        # every replica's loss reads the same global statistics: their diffs add up
        diff = super().shared_statistics_diff(statistics_tops)
        self.share(diff.reshape(-1))
        return diff
