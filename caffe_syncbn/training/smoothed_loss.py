"""The loss a solver displays: Caffe's UpdateSmoothedLoss, the mean of the last
``average_loss`` iterations' losses, kept in the solver's float type as Caffe keeps it."""
import numpy as np


class SmoothedLoss:
    """The window of one ``step`` call's losses (a new call starts a new window)."""

    def __init__(self, average, dtype, start_iter=0):
        self.average, self.start_iter = average, start_iter
        self.d = np.dtype(dtype).type
        self.losses, self.value = [], 0.0

    def add(self, loss, iteration):
        """Take iteration ``iteration``'s loss into the mean."""
        d, loss = self.d, self.d(loss)
        if len(self.losses) < self.average:
            self.losses.append(loss)
            n = len(self.losses)
            self.value = float((d(self.value) * d(n - 1) + loss) / d(n))
        else:
            slot = (iteration - self.start_iter) % self.average
            self.value = float(d(self.value) + (loss - self.losses[slot]) / d(self.average))
            self.losses[slot] = loss
