"""Normalization: batch normalization's three forms (Caffe's BatchNorm, the BN of the
segmentation forks, our SyncBN over the global batch) with their chain and engines."""
