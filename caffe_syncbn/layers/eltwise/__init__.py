"""Eltwise, and the fused sum + ReLU that runs when the memory plan gives it the ReLU
after it (gpu.py, cuda/eltwise.cu)."""
