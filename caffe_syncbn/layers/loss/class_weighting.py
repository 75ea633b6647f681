"""SegNet's and ENet's SoftmaxWithLoss with loss_param { weight_by_label_freqs: true
class_weighting: ... } (their softmax_loss_layer.cpp): each pixel's -log p[label] and its
gradient times class_weighting[label], the sum divided as SoftmaxWithLoss divides it (by
the count of the pixels not ignored, by default, not by the sum of their weights). That is
InfogainLoss with H = diag(class_weighting), which this layer runs; without the flag the
forks ignore class_weighting, and so does SoftmaxWithLoss here."""
import numpy as np

from ...layer import register_variant
from .layers import InfogainLossLayer, ignore_label_of


def weights_by_class(param):
    return param.loss_param.weight_by_label_freqs


@register_variant('SoftmaxWithLoss', weights_by_class)
class ClassWeightedSoftmaxLoss(InfogainLossLayer):
    """SoftmaxWithLoss weighted by the class of each label (module docstring)."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, minimum=1, maximum=2)
        self.ignore_label = ignore_label_of(self.param.loss_param)
        self.mode = self.normalization_mode()
        weights = np.asarray(self.param.loss_param.class_weighting, np.float64)
        self.file_matrix = self.xp.asarray(np.diag(weights).ravel(), dtype=self.dtype)

    def axis_param(self):
        return self.param.softmax_param.axis

    def reshape(self, bottom, top):
        count = len(self.param.loss_param.class_weighting)
        super(InfogainLossLayer, self).reshape(bottom, top)
        if count != self.classes:
            raise self.error('weight_by_label_freqs needs one class_weighting per class: got %d '
                             'values for %d classes' % (count, self.classes))
