"""Convolution's host engine (numpy): it runs a layer, at its present shape, with the host
passes that suit it, and has the array engine's signatures (array.py): the chunked GEMMs
and 1x1 GEMMs (host_gemm.py); depthwise (de)convolutions' shifted multiply-adds
(host_depthwise.py); Winograd's F(2x2, 3x3) for 3x3 stride-1 convolutions whose shape pays
for it (host_winograd.py, ``engine: CAFFE`` keeps im2col); and the array engine for the
Deconvolutions that are not depthwise. Which of them may run is chosen once, in setup
(the layer's ``depthwise`` and ``winograd``); whether Winograd pays, at each shape.
"""
from . import array, host_depthwise, host_gemm, host_winograd


def runs(layer):
    """The module whose passes run ``layer`` at its present shape."""
    if layer.transposed:
        return host_depthwise if layer.depthwise else array
    if layer.depthwise and not layer.pointwise:
        return host_depthwise
    if layer.winograd and host_winograd.pays(layer):
        return host_winograd
    return host_gemm


def forward(layer, x, y3):
    runs(layer).forward(layer, x, y3)


def backward(layer, x, dy3, dx, weight_grad):
    runs(layer).backward(layer, x, dy3, dx, weight_grad)
