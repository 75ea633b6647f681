"""DeepLab's SegAccuracy (seg_accuracy_layer.cpp, util/confusion_matrix.cpp): a confusion
matrix of each pixel's true class against the class of its highest score, over the pixels
whose label is not one of seg_accuracy_param's ignore_label values, added up over forwards
unless ``reset`` (the default) clears it before each.

The top, 1 x 1 x 1 x 3, holds DeepLab's three numbers of the matrix M:
  pixel accuracy   trace(M) / sum(M) (0 for an empty M)
  class recall     the mean of M[c, c] / sum(M[c, :]) over the classes that have pixels
  Jaccard (IoU)    the mean over every class of M[c, c] / (sum(M[c, :]) + sum(M[:, c])
                   - M[c, c]), where a class absent from labels and predictions counts 1
Ties between scores go to the highest class, as DeepLab's sort of (score, class) pairs
leaves them. A label outside [0, classes) that is not ignored stops the net (DeepLab's
LOG(FATAL)) with a line naming it. The matrix stays on the device: nothing is read back.
"""
from ...layer import Layer, register


@register('SegAccuracy')
class SegAccuracyLayer(Layer):
    """Scores N x C x H x W and labels N x 1 x H x W in; DeepLab's three numbers out."""

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=2)
        self.check_tops(top, exact=1)
        p = self.param.seg_accuracy_param
        self.ignored = sorted(set(p.ignore_label))
        self.reset = p.reset
        self.matrix = None

    def reshape(self, bottom, top):
        scores, labels = bottom[0].shape, bottom[1].shape
        if len(scores) != 4 or len(labels) != 4:
            raise self.error('needs 4-D scores and labels, got shapes %s and %s'
                             % (scores, labels))
        if labels[1] != 1 or (scores[0],) + scores[2:] != (labels[0],) + labels[2:]:
            raise self.error('labels must be N x 1 x H x W of scores N x C x H x W, got shapes '
                             '%s and %s' % (labels, scores))
        self.classes = scores[1]
        top[0].reshape((1, 1, 1, 3))

    def forward(self, bottom, top):
        xp, classes = self.xp, self.classes
        scores = bottom[0].data
        predicted = classes - 1 - xp.argmax(scores[:, ::-1], axis=1)    # ties: highest class
        raw = bottom[1].data[:, 0]
        label = raw.astype(xp.int64)
        valid = xp.ones(label.shape, bool)
        for value in self.ignored:
            valid &= label != value
        bad = valid & ((label < 0) | (label >= classes))
        self.ctx.check_later(self, bad.any(), lambda: 'unexpected label %g (classes 0 to %d, '
                                                      'ignored: %s)' % (float(raw[bad][0]),
                                                                        classes - 1,
                                                                        self.ignored or 'none'))
        pairs = (label * classes + predicted)[valid & ~bad]
        counts = xp.bincount(pairs, minlength=classes * classes).reshape(classes, classes)
        if self.reset or self.matrix is None or self.matrix.shape != counts.shape:
            self.matrix = counts
        else:
            self.matrix = self.matrix + counts
        top[0].data[...] = self.scores(self.matrix).reshape(1, 1, 1, 3).astype(self.dtype)

    def scores(self, matrix):
        """(pixel accuracy, mean class recall, mean Jaccard) of a confusion matrix."""
        xp = self.xp
        m = matrix.astype(xp.float64)
        hits, rows, cols = xp.diagonal(m), m.sum(axis=1), m.sum(axis=0)
        total = m.sum()
        accuracy = xp.where(total > 0, hits.sum() / xp.maximum(total, 1), 0)
        present = rows > 0
        recall = xp.where(present, hits / xp.maximum(rows, 1), 0).sum() / \
            xp.maximum(present.sum(), 1)
        union = rows + cols - hits
        jaccard = xp.where(union == hits, 1, hits / xp.maximum(union, 1)).mean()
        return xp.stack([accuracy, recall, jaccard])

    def allow_force_backward(self, bottom_index):
        return False
