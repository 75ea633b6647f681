"""Softmax. SoftmaxWithLoss is in the loss family."""
