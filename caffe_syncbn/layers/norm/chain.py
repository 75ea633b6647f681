"""A batch norm that runs the Scale and ReLU after it (memory plan 'inplace_abn'): one
pass forward, and a backward that finds x_hat from the chain's output y instead of a kept
copy of it, as in-place activated batch norm does.

x_hat = (p - beta) / gamma, with p = y where y > 0 and y / s elsewhere (s: the ReLU's
negative slope; without a ReLU, p = y). A ReLU of slope 0 loses p where y <= 0, and the
batch-statistics gradient needs x_hat there too, so such a chain keeps x_hat: one copy,
where BatchNorm and Scale run in place keep two. Recovery divides by gamma and subtracts
beta/gamma: on a step where some channel has |beta| > RECOVERY_RATIO * |gamma| (gamma 0
included), the chain keeps x_hat instead, exactly, and logs it once. Otherwise the
recovered x_hat is within about 2 * eps * (|x_hat| + RECOVERY_RATIO) of the kept one
(eps: the work dtype's machine epsilon).
"""
import logging

from ...backend import get_array_module, to_numpy
from .array import STAT

log = logging.getLogger('caffe_syncbn')

RECOVERY_RATIO = 64.0


class Chain:
    """What a batch norm absorbed: the Scale (``affine_owner``, whose blobs ``gamma_index``
    and ``beta_index`` are gamma and beta) unless the norm has its own, the ReLU's negative
    slope (None: no ReLU), and the top the chain writes."""

    def __init__(self, affine_owner=None, beta_index=None, gamma_index=0):
        self.affine_owner, self.beta_index = affine_owner, beta_index
        self.gamma_index = gamma_index
        self.negative_slope = None
        self.top = None
        self.warned = False

    def offer(self, layer, channels):
        """Take ``layer`` if it continues the chain: a per-channel Scale before any ReLU
        (when the norm has no affine part of its own), then a ReLU of slope >= 0."""
        if layer.type == 'Scale' and self.affine_owner is None \
                and self.negative_slope is None and len(layer.blobs) >= 1 \
                and layer.blobs[0].shape == (channels,) and layer.param.scale_param.axis == 1:
            self.affine_owner, self.gamma_index = layer, 0
            self.beta_index = 1 if len(layer.blobs) > 1 else None
            return True
        if layer.type == 'ReLU' and self.negative_slope is None \
                and layer.param.relu_param.negative_slope >= 0:
            self.negative_slope = float(layer.param.relu_param.negative_slope)
            return True
        return False

    def gamma(self):
        owner = self.affine_owner
        return None if owner is None else \
            owner.blobs[self.gamma_index].data.reshape(-1).astype(STAT)

    def beta(self):
        owner = self.affine_owner
        if owner is None:
            return None
        if self.beta_index is None:                # a Scale without bias_term
            return 0 * self.gamma()
        return owner.blobs[self.beta_index].data.reshape(-1).astype(STAT)

    def wants_gamma_gradient(self):
        return self.affine_owner is not None and \
            self.affine_owner.wants_param_gradient(self.gamma_index)

    def add_param_gradients(self, sum_g, sum_g_x_hat):
        """d gamma += sum(g * x_hat), d beta += sum(g), as the affine part's owner wants."""
        owner = self.affine_owner
        if owner is None:
            return
        for index, values in ((self.gamma_index, sum_g_x_hat), (self.beta_index, sum_g)):
            if index is not None and values is not None and owner.wants_param_gradient(index):
                blob = owner.blobs[index]
                blob.diff += values.reshape(blob.shape).astype(blob.dtype)

    def may_recover(self, survives, batch_formula):
        """Whether the backward may find x_hat from the output, as far as the chain's shape
        tells: without the batch formula only gamma's gradient reads x_hat, and only where
        the ReLU passes a gradient, so a ReLU of slope 0 loses nothing it needs."""
        return survives and not (self.negative_slope == 0 and batch_formula)

    def recovery_flag(self):
        """Whether this step's gamma and beta let the backward find x_hat from the output
        (see the module docstring): a 1-element bool array on their device, or None when
        the norm's own affine part is absent (nothing to divide by)."""
        gamma, beta = self.gamma(), self.beta()
        if gamma is None:
            return None
        xp = get_array_module(gamma)
        return xp.logical_and((abs(beta) <= RECOVERY_RATIO * abs(gamma)).all(),
                              (gamma != 0).all()).reshape(1)

    def recovers(self, layer_name, survives, batch_formula, decided=None):
        """Whether the backward may find x_hat from the output this step; says once why not
        when gamma is the reason. ``decided``: the host value of ``recovery_flag`` read
        before the pass (Layer.before_pass), else it is read here."""
        if not self.may_recover(survives, batch_formula):
            return False
        if decided is None:
            flag = self.recovery_flag()
            decided = True if flag is None else bool(to_numpy(flag)[0])
        if not decided and not self.warned:
            self.warned = True
            log.info("layer '%s': a channel's gamma is (near) zero against its beta: the "
                     'backward keeps x_hat instead of finding it from the output', layer_name)
        return decided
