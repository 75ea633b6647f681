"""Convolution, Deconvolution, Im2col and the depthwise convolutions of MobileNet's forks
(ConvolutionDepthwise, DepthwiseConvolution), which are Convolutions with one group per
channel. Engines: the array im2col (array.py), the host's chunked GEMMs (host.py, with
host_columns.py), its depthwise and Winograd passes (host_depthwise.py, host_winograd.py)
and the CUDA im2col (gpu.py, cuda/conv.cu)."""
