"""Batch normalization: BVLC's BatchNorm, the BN of the PSPNet/yjxiong forks, and SyncBN.

Statistics are per channel (axis 1) over every other axis; an (N, C) blob counts as
(N, C, 1, 1) and an (N,) blob as one channel.

BatchNorm (BVLC): blobs [mean_sum, var_sum, scale factor (1,)], no affine part; its
running statistics are sums (``RunningSums``).
BN (forks, ``bn_param``): blobs [slope, bias, running mean, running var], each
1xCx1x1; ``running = momentum*running + (1-momentum)*batch`` (``RunningAverage``) with
the BIASED batch variance; ``frozen`` uses the running stats and learns nothing; in TEST
its backward still applies the batch-statistics formula (a quirk kept for fidelity).

SyncBN (type ``SyncBN``, ``bn_param``, BN's 4 blobs, or [slope, bias, mean_sum, var_sum,
s] with ``statistics: BATCHNORM``) normalizes with the statistics of the GLOBAL batch, the
union of every replica's local batch:

* TRAIN forward: each replica packs [count, sum(x-K) (C), sum((x-K)^2) (C)] into
  one float64 buffer and makes ONE ``ctx.group_comm.allreduce(buffer, tag=layer name)``
  (group_comm: every replica, or the layer's group of them under sync_bn_group_size).
  K is the running mean, identical on every replica. The local sums are exact:
  each replica takes them about its OWN local mean L (two passes, no cancellation,
  in the blob dtype but at least float32) and moves them to K in float64 by
  sum(x-K) = s1 + c*(L-K), sum((x-K)^2) = s2 + 2*(L-K)*s1 + c*(L-K)^2. The global
  variance sum((x-K)^2)/m - (mean-K)^2 then cancels only in float64 (relative error
  ~1e-16*(mean-K)^2/var), so even the first step, with K still 0, is accurate for
  data with mean 1e4 and std 1, and the error shrinks as K approaches the mean.
  y normalizes with the biased global variance. The running statistics take the
  UNBIASED global variance var*m/(m-1) (m = global count, as yjxiong's sync_bn_layer,
  PyTorch and BVLC's BatchNorm), in the convention ``bn_param.statistics`` names:
  MOMENTUM, the forks' average in blobs [mean, var] (SyncBN alone, group_comm None, then
  equals BN except that its running variance is m/(m-1) larger), or BATCHNORM, BVLC
  BatchNorm's sums in blobs [mean_sum, var_sum, s] (what a converted BatchNorm keeps, so
  that its blobs are those of Caffe's BatchNorm on one device with the global batch).
  Every replica gets bitwise the same running stats. A batch whose mean or variance is
  not finite leaves them as they were, on every replica alike (update_statistics).
* TRAIN backward: ONE allreduce of [sum(dy), sum(dy*x_hat)] (2C), then dx with
  the global count m. It is skipped, on every replica alike, when dx is not needed.
* Parameter gradients: dslope = sum(dy*x_hat) and dbias = sum(dy) over the LOCAL
  batch, like every other layer's param diffs. The data-parallel solver averages
  param diffs over the R replicas, and the global loss normalizer
  (syncbn_policy.loss_normalizer) makes each replica's top diff R times the
  one-device gradient of its samples, so the average is exactly the one-device
  gradient of the whole batch; put plainly, the SUM over replicas of the local
  param diffs is the gradient of the loss whose gradient the top diffs are.
  (Using the all-reduced global sums instead would count each sample R times.)
* TEST phase, or ``frozen: true``: the running stats, no communication. Unlike
  BN, the TEST backward is the true gradient of the TEST forward (dx = dy*slope/std),
  and a frozen SyncBN still learns its slope and bias as their ParamSpecs say (the
  forks' frozen BN fixes them): it is BVLC's BatchNorm with use_global_stats followed
  by a Scale, which is what --sync-bn turns that pair into.
* Uneven local batches are exact; a replica with an EMPTY local batch (N=0) joins
  both collectives, gets the same running stats and an output of shape (0, C, ...).

The layers below hold these rules, both allreduces included; the passes over the data are
an engine's (array.py says what one does), chosen once at setup: the CUDA kernels
(gpu.py), the host's blocked passes (host.py), or array code (array.py).
"""
import numpy as np

from ... import caffe_pb2
from ...layer import TEST, Layer, register
from ...syncbn_policy import keeps_sums
from . import array, gpu, host
from .array import (STAT, FirstCopyAverage, RunningAverage, RunningSums, channel_view,
                    inverse_std, moments)
from .chain import Chain


class ChannelNorm(Layer):
    """What the three layers share: shapes, the engine, the per-channel statistics as
    float64, the x_hat the backward reads, and the Scale and ReLU they may absorb
    (chain.py)."""

    #: what this layer absorbed (Layer.absorb), or None
    chain = None
    #: whether its batch statistics and their gradient sums span the replicas of
    #: ``ctx.group_comm`` (the SyncBN kinds), or this replica's batch alone
    synchronized = False
    #: whether the chain may find x_hat from the output this pass, read before it (decided)
    _recovery_decided = None

    def setup_channels(self, bottom, top, most_tops=1):
        self.check_bottoms(bottom, exact=1)
        if most_tops == 1:
            self.check_tops(top, exact=1)
        else:
            self.check_tops(top, minimum=1, maximum=most_tops)
        self.channels = bottom[0].shape[1] if bottom[0].num_axes > 1 else 1
        if self.cuda_kernels:
            self.engine = gpu
        elif self.xp is np:
            self.engine = host
        else:
            self.engine = array
        self._x_hat_buffer = None

    def reshape(self, bottom, top):
        shape = bottom[0].shape
        channels = shape[1] if len(shape) > 1 else 1
        if channels != self.channels:
            raise self.error('expected %d channels (axis 1), got bottom shape %s'
                             % (self.channels, shape))
        top[0].reshape(shape)

    def stat(self, j):
        return self.blobs[j].data.reshape(-1).astype(STAT)

    def add_param_gradient(self, j, values):
        blob = self.blobs[j]
        blob.diff += values.reshape(blob.shape).astype(self.dtype)

    def local_moments(self, x3, reference=None):
        """(count, mean, biased var) of this forward's batch; ``share`` joins the
        replicas' sums first (SyncBN)."""
        packed, shift = self.engine.local_sums(x3, reference)
        self.share(packed)
        if x3.shape[0] * x3.shape[2] == 0 and float(packed[0]) == 0:   # the only read-back
            raise self.error(self.empty_batch_message(x3.shape))
        return moments(packed, shift)

    def share(self, packed):
        """Sum per-channel sums over the replicas of ``ctx.group_comm`` where the layer is
        ``synchronized``; alone, nothing to do."""
        if self.synchronized and self.ctx.group_comm is not None:
            self.ctx.group_comm.allreduce(packed, tag=self.name)

    def empty_batch_message(self, shape):
        return 'cannot take batch statistics of an empty batch (shape %s)' % (shape,)

    def use_running_statistics(self):
        """From now on, normalize with the running statistics and update none, as in TEST,
        whatever the phase: PreciseBN (training/precise_bn.py) runs the layers before the
        one it estimates so, on their new statistics."""
        raise NotImplementedError

    def absorb(self, layer, top):
        chain = self.chain or self.new_chain()
        if not chain.offer(layer, self.channels):
            return False
        chain.top = top
        self.chain = chain
        return True

    def new_chain(self):
        return Chain()

    def before_pass(self):
        chain = self.chain
        if chain is None or not chain.may_recover(self.output_survives,
                                                  self.uses_batch_formula()):
            return None
        return chain.recovery_flag()

    def decided(self, values):
        self._recovery_decided = bool(values[0])

    def output(self, top):
        """The blob this layer's forward writes: its chain's top, or its own."""
        return self.chain.top if self.chain is not None else top[0]

    def recomputable(self, bottom, top):
        # in place with the batch formula (after a ReLU of slope 0, if any), x_hat is kept:
        # the output is its affine map, written again for the first backward that reads it
        output = self.output(top)
        keeps = output is bottom[0] and self.uses_batch_formula() and \
            (self.chain is None or self.chain.negative_slope == 0)
        return [output] if keeps else []

    def recompute(self, top):
        if self.chain is not None:
            slope, bias, activation = self.chain.gamma(), self.chain.beta(), 0.0
        else:
            (slope, bias), activation = self.affine(), None
        self.engine.output_from_x_hat(self._x_hat, channel_view(top.data), slope, bias,
                                      activation)

    def backward_reads(self, bottom, top):
        # x_hat comes from a kept copy, from the input (apart) or from the chain's output,
        # whose sign the ReLU's gradient reads too
        output = self.output(top)
        reads = [bottom[0]] if output is not bottom[0] else []
        return reads + ([output] if self.chain is not None else [])

    def normalize(self, bottom, top, mean, keep_x_hat, slope=None, bias=None):
        """y into the top (the chain's, which applies its affine part and ReLU); keeps what
        the backward reads x_hat from, if it reads it."""
        chain, activation, top = self.chain, None, [self.output(top)]
        if chain is not None:
            activation = chain.negative_slope
            slope, bias = chain.gamma(), chain.beta()
            keep_x_hat = self.uses_batch_formula() or chain.wants_gamma_gradient()
        x3, y3 = channel_view(bottom[0].data), channel_view(top[0].data)
        keep_x_hat = keep_x_hat and self.backward_runs
        buffer = None
        in_place = top[0] is bottom[0] or top[0].data is bottom[0].data
        # in place, the chain finds x_hat from its output if it can; apart, from its input
        decided, self._recovery_decided = self._recovery_decided, None
        self._recovered = keep_x_hat and in_place and chain is not None and \
            chain.recovers(self.name, self.output_survives, self.uses_batch_formula(), decided)
        keep_x_hat = keep_x_hat and not self._recovered
        if keep_x_hat and in_place:           # the input is gone once y is written
            buffer = self._x_hat_buffer
            if buffer is None or buffer.shape != x3.shape or buffer.dtype != x3.dtype:
                buffer = self._x_hat_buffer = self.xp.empty_like(x3)
        self._x_hat = self.engine.normalize(x3, y3, mean, self._inv_std, slope, bias,
                                            keep_x_hat, buffer, activation)

    def batch_gradient_sums(self, sum_dy, sum_dy_x_hat):
        """The sums dx takes with the batch-statistics formula, or None for dx = dy * scale."""
        return (sum_dy, sum_dy_x_hat) if self.uses_batch_formula() else None

    def chain_backward(self, propagate_down, bottom):
        """The chain's backward, from its top's diff: through the ReLU, the affine part's
        param diffs, then the batch norm's, with x_hat found from the output or kept."""
        chain = self.chain
        y3, dy3 = channel_view(chain.top.data), channel_view(chain.top.diff)
        gamma, beta = chain.gamma(), chain.beta()
        x_hat = self._x_hat
        if self._recovered:
            x_hat = self.engine.x_hat_from_output(y3, gamma, beta, chain.negative_slope)
        g3 = self.engine.activation_gradient(y3, dy3, chain.negative_slope, x_hat)
        sum_g, sum_g_x_hat = self.engine.gradient_sums(g3, x_hat)
        chain.add_param_gradients(sum_g, sum_g_x_hat)
        if not propagate_down[0]:
            return
        scale = self._inv_std if gamma is None else gamma * self._inv_std
        dx3 = channel_view(bottom[0].diff)
        sums = self.batch_gradient_sums(sum_g, sum_g_x_hat)
        if sums is None:
            self.engine.input_gradient(dx3, g3, scale, x_hat)
        else:
            self.engine.input_gradient(dx3, g3, scale, x_hat, *sums, count=self._count)


@register('BatchNorm')
class BatchNorm(ChannelNorm):
    """BVLC BatchNorm: y = (x - mean) / sqrt(var + eps)."""

    def setup(self, bottom, top):
        self.setup_channels(bottom, top)
        p = self.param.batch_norm_param
        self.use_global_stats = (p.use_global_stats if p.HasField('use_global_stats')
                                 else self.phase == TEST)
        self.statistics = RunningSums(self, 0, p.moving_average_fraction)
        self.eps = p.eps
        for j, spec in enumerate(self.param.param[:3]):
            if spec.lr_mult != 0:
                raise self.error('param %d has lr_mult %g: the statistics of batch normalization '
                                 'cannot be learned (use lr_mult 0 or leave it out)'
                                 % (j, spec.lr_mult))
        self.blobs = [self.make_blob(shape)
                      for shape in self.statistics.blob_shapes((self.channels,))]
        self.param_propagate_down = [False] * 3

    def fixed_param_mults(self, index):
        return (0.0, None) if index < 3 else None

    def use_running_statistics(self):
        self.use_global_stats = True

    def uses_batch_formula(self):
        return not self.use_global_stats

    def affine(self):
        return None, None

    def forward(self, bottom, top):
        if self.use_global_stats:
            mean, var = self.statistics.running()
        else:
            self._count, mean, var = self.local_moments(channel_view(bottom[0].data))
            self.statistics.update(self._count, mean, var)
        self._inv_std = inverse_std(var, self.eps)
        self.normalize(bottom, top, mean, not self.use_global_stats)

    def backward(self, top, propagate_down, bottom):
        if self.chain is not None:
            return self.chain_backward(propagate_down, bottom)
        if not propagate_down[0]:
            return
        dy3, dx3 = channel_view(top[0].diff), channel_view(bottom[0].diff)
        if self.use_global_stats:
            self.engine.input_gradient(dx3, dy3, self._inv_std)
            return
        sums = self.engine.gradient_sums(dy3, self._x_hat)
        self.engine.input_gradient(dx3, dy3, self._inv_std, self._x_hat, *sums, count=self._count)


@register('BN')
class BN(ChannelNorm):
    """BN of the PSPNet/yjxiong forks: y = slope * x_hat + bias (see the module docstring)."""

    SLOPE, BIAS, STATISTICS = range(3)     # STATISTICS: the first blob of the running ones

    def setup(self, bottom, top):
        self.setup_channels(bottom, top)
        p = self.param.bn_param
        self.eps, self.frozen = p.eps, p.frozen
        self.statistics = self.make_statistics(p)
        shape = (1, self.channels, 1, 1)
        self.blobs = [self.make_blob(shape, p.slope_filler), self.make_blob(shape, p.bias_filler)]
        self.blobs += [self.make_blob(s) for s in self.statistics.blob_shapes(shape)]
        if self.frozen:
            self.statistics.start_frozen()
        self.param_propagate_down = [not self.affine_frozen] * 2 + \
            [False] * (len(self.blobs) - 2)
        self.use_running_stats = self.frozen or self.phase == TEST

    def make_statistics(self, p):
        """How this layer keeps its running statistics (BN: the biased batch variance)."""
        return RunningAverage(self, self.STATISTICS, p.momentum, unbiased_variance=False)

    @property
    def affine_frozen(self):
        """Whether slope and bias are fixed whatever the ParamSpecs say (the forks' frozen)."""
        return self.frozen

    def fixed_param_mults(self, index):
        return (0.0, 0.0) if index >= 2 or self.affine_frozen else None

    def wants_param_gradient(self, index):
        # frozen, slope and bias are fixed even where force_backward asks for every
        # param's gradient: the forks' BN learns nothing, alone or running a chain
        return not self.affine_frozen and super().wants_param_gradient(index)

    def uses_batch_formula(self):
        """The forks' BN applies the batch-statistics formula in TEST too (with the running
        x_hat); frozen, dx = dy * slope / std."""
        return not self.affine_frozen

    def new_chain(self):
        return Chain(affine_owner=self, beta_index=self.BIAS)

    def affine(self):
        return self.stat(self.SLOPE), self.stat(self.BIAS)

    def batch_moments(self, x3):
        """(count, mean, biased var) of this forward's batch, about its own mean."""
        return self.local_moments(x3)

    def forward(self, bottom, top):
        x3 = channel_view(bottom[0].data)
        if self.use_running_stats:
            mean, var = self.statistics.running()
            self._count = self.xp.full(1, x3.shape[0] * x3.shape[2], STAT)
        else:
            self._count, mean, var = self.batch_moments(x3)
            self.update_statistics(self._count, mean, var)
        self._inv_std = inverse_std(var, self.eps)
        self.normalize(bottom, top, mean, self.backward_reads_x_hat(), *self.affine())

    def update_statistics(self, count, mean, var):
        """The running statistics take this batch's (the forks' BN: whatever they are)."""
        self.statistics.update(count, mean, var)

    def use_running_statistics(self):
        self.use_running_stats = True

    def backward_reads_x_hat(self):
        return not self.affine_frozen

    def backward(self, top, propagate_down, bottom):
        if self.chain is not None:
            return self.chain_backward(propagate_down, bottom)
        dy3, dx3 = channel_view(top[0].diff), channel_view(bottom[0].diff)
        scale = self.stat(self.SLOPE) * self._inv_std
        if self.affine_frozen:
            if propagate_down[0]:
                self.engine.input_gradient(dx3, dy3, scale)
            return
        # without x_hat (a SyncBN on running statistics whose slope is not learned) only
        # sum(dy) is taken
        sum_dy, sum_dy_x_hat = self.engine.gradient_sums(dy3, self._x_hat)
        if self.wants_param_gradient(self.SLOPE):
            self.add_param_gradient(self.SLOPE, sum_dy_x_hat)
        if self.wants_param_gradient(self.BIAS):
            self.add_param_gradient(self.BIAS, sum_dy)
        if not propagate_down[0]:
            return
        sums = self.batch_gradient_sums(sum_dy, sum_dy_x_hat)
        if sums is None:
            self.engine.input_gradient(dx3, dy3, scale)
        else:
            self.engine.input_gradient(dx3, dy3, scale, self._x_hat, *sums, count=self._count)


@register('SyncBN')
class SyncBN(BN):
    """BN with the statistics of the global batch across ``ctx.group_comm`` (module
    docstring)."""

    affine_frozen = False
    synchronized = True

    def make_statistics(self, p):
        if keeps_sums(self.param):
            return RunningSums(self, self.STATISTICS, p.momentum)
        if p.statistics == caffe_pb2.BNParameter.NVCAFFE:
            return FirstCopyAverage.of_engine(self, self.STATISTICS, p.momentum, p.engine)
        return RunningAverage(self, self.STATISTICS, p.momentum, unbiased_variance=True)

    def batch_moments(self, x3):
        # about the running mean, identical on every replica, so that the sums add up; in
        # the blob dtype, which every engine holds exactly
        reference = self.statistics.running()[0].astype(self.dtype).astype(STAT)
        return self.local_moments(x3, reference=reference)

    def empty_batch_message(self, shape):
        comm = self.ctx.group_comm
        if comm is None or comm.size == 1:
            return super().empty_batch_message(shape)
        whose = 'global batch' if comm.size == self.ctx.replicas else \
            'batch of its group of %d replicas' % comm.size
        return 'the %s is empty (local shape %s on every replica)' % (whose, shape)

    def update_statistics(self, count, mean, var):
        """Every replica of the group holds the same reduced sums, so one check of the
        mean and variance they give lets all of them skip the update alike: on the device,
        with a ``where``, and counted with the pass's loss (skipped_statistics). mean + var
        is finite when both are (var is never -inf; short of a sum past 1e308, no
        statistic to keep either), and they are when the 2C + 1 sums are (the count being
        positive)."""
        kept = ~self.xp.isfinite(mean + var).all()
        self.statistics.update(count, mean, var, kept=kept)
        self.ctx.read_later(kept, self.count_skipped)

    def count_skipped(self, skipped):
        if skipped:
            self.skipped_statistics += 1

    def uses_batch_formula(self):
        return not self.use_running_stats

    def backward_reads_x_hat(self):
        return not self.use_running_stats or self.wants_param_gradient(self.SLOPE)

    def batch_gradient_sums(self, sum_dy, sum_dy_x_hat):
        if self.use_running_stats:               # the true gradient of the TEST forward
            return None
        packed = self.xp.concatenate([sum_dy, sum_dy_x_hat])
        self.share(packed)
        return packed[:self.channels], packed[self.channels:]
