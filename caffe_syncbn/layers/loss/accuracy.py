"""Accuracy: the share of samples whose true label is among the top_k scores."""

from ...layer import Layer, register
from .layers import class_labels, ignore_label_of, split_at


@register('Accuracy')
class AccuracyLayer(Layer):
    """Fraction of items whose label is among the top_k scores; forward only.

    A class scoring ``>=`` the true class counts as better, so ties count against it.
    An optional second top holds the accuracy per class (0 for a class with no items).
    """

    def full_precision_top(self, index):
        return True           # fractions of counts, as Caffe reports them

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, minimum=1, maximum=2)
        accuracy_param = self.param.accuracy_param
        self.top_k = accuracy_param.top_k
        self.ignore_label = ignore_label_of(accuracy_param)

    def reshape(self, bottom, top):
        self.outer, self.classes, self.inner = split_at(self, bottom[0],
                                                        self.param.accuracy_param.axis)
        if self.top_k > self.classes:
            raise self.error('top_k (%d) exceeds the number of classes (%d)'
                             % (self.top_k, self.classes))
        top[0].reshape(())
        if len(top) > 1:
            top[1].reshape(self.classes)

    def forward(self, bottom, top):
        xp = self.xp
        scores = bottom[0].data.reshape(self.outer, self.classes, self.inner)
        label, valid = class_labels(self, bottom[1], (self.outer, self.inner), self.classes,
                                    self.ignore_label)
        true_score = xp.take_along_axis(scores, label[:, None, :], axis=1)
        at_least_as_good = xp.sum(scores >= true_score, axis=1)    # includes the true class
        correct = (at_least_as_good <= self.top_k) & valid
        count = xp.sum(valid)
        top[0].data[...] = xp.where(count > 0, xp.sum(correct) / xp.maximum(count, 1), 0)
        if len(top) > 1:
            flat_label = label[valid]
            per_class = xp.bincount(flat_label, minlength=self.classes)
            hits = xp.bincount(flat_label, weights=correct[valid].astype(self.dtype),
                               minlength=self.classes)
            top[1].data[...] = hits / xp.maximum(per_class, 1)

    def allow_force_backward(self, bottom_index):
        return False
