"""CUDA implementations of hot layer steps, behind the same functions as the CPU layers.

Imported only when a layer runs on CuPy arrays (never by the CPU code paths). The
functions get their array module from their arguments and their kernels through
``caffe_syncbn.cuda_kernels``, so the tests run them on numpy arrays over a CPU
emulation of the kernels (tests/cuda_emulation.py).
"""
