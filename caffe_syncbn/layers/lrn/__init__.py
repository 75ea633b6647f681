"""LRN (local response normalization) across or within channels: the host's blocked
bands and array code (layers.py), the CUDA kernels (gpu.py, cuda/lrn.cu)."""
