"""Interp (PSPNet's fork): bilinear resizing, with the CUDA kernels in gpu.py
(cuda/interp.cu)."""
