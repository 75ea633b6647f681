"""Normalization: batch normalization's forms (Caffe's BatchNorm, the BN of the segmentation
forks, our SyncBN over the global batch) with their chain and engines (batch_norm.py,
chain.py; array.py, the array engine that states an engine's functions, host.py, gpu.py over
cuda/norm.cu), and NVCaffe's BatchNorm with its own scale and bias (nvcaffe.py), which runs
BN's passes; MVN (mvn.py) and SSD's Normalize (normalize.py), which normalize by statistics
of each item."""
