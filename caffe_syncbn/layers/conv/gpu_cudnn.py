"""Convolution's cuDNN engine: the array engine's passes (array.py) as cuDNN's fprop, dgrad
and wgrad graphs (backend/cudnn_conv.py), for 2-D and 3-D (de)convolutions whose inputs,
outputs and weights share float32 or float16. Off unless ``CAFFE_SYNCBN_CUDNN=1``: it has
not yet run on a GPU. What it does not take (float64, float16 activations over float32
weights under mixed precision, a geometry for which cuDNN builds no plan) it hands to the
CUDA im2col engine (gpu.py), or for 3-D to the array engine.

A Deconvolution is its underlying convolution run the other way: its forward is that
convolution's dgrad, its data gradient the fprop, and the weight gradient a wgrad whose
input is the Deconvolution's output. Caffe adds weight gradients to the diff; a wgrad graph
writes its output, so it writes a buffer that is then added.
"""
from ...backend import cudnn_conv, get_array_module
from ...backend.launch import contiguous
from . import array, gpu


def chosen(num_spatial, dtype):
    """Whether a layer set up now over ``num_spatial`` axes in ``dtype`` may take this
    engine: the switch is on, the frontend imports, and cuDNN takes the dtype."""
    return cudnn_conv.applies(dtype, dtype, num_spatial)


def _takes(layer, x):
    return cudnn_conv.applies(x.dtype, layer.blobs[0].data.dtype, layer.num_spatial)


def _fallback(layer):
    return gpu if layer.num_spatial == 2 else array


def _geometry(layer):
    return layer.pad, layer.stride, layer.dilation


def forward(layer, x, y3):
    if _takes(layer, x):
        try:
            return _forward(layer, x, y3)
        except cudnn_conv.NoPlan:
            pass
    _fallback(layer).forward(layer, x, y3)


def _forward(layer, x, y3):
    xp = get_array_module(x)
    x = contiguous(xp, x)
    weight = layer.blobs[0].data
    y = y3.reshape((layer.batch, layer.num_output) + tuple(layer.out_spatial))
    if layer.transposed:
        cudnn_conv.run('dgrad', y, weight, x, *_geometry(layer))
    else:
        cudnn_conv.run('fprop', x, weight, y, *_geometry(layer))
    if layer.bias_term:
        y3 += layer.blobs[1].data.reshape(-1, 1)


def backward(layer, x, dy3, dx, weight_grad):
    if _takes(layer, x):
        try:
            return _backward(layer, x, dy3, dx, weight_grad)
        except cudnn_conv.NoPlan:
            pass
    _fallback(layer).backward(layer, x, dy3, dx, weight_grad)


def _backward(layer, x, dy3, dx, weight_grad):
    """Each pass is planned before it is enqueued, and the weight gradient is added only
    once both are: a NoPlan of either leaves nothing half done for the fallback."""
    xp = get_array_module(x)
    x = contiguous(xp, x)
    dy = contiguous(xp, dy3.reshape((layer.batch, layer.num_output) + tuple(layer.out_spatial)))
    weight = layer.blobs[0].data
    # the underlying convolution's input and output
    image, output = (dy, x) if layer.transposed else (x, dy)
    written = target = None
    if weight_grad is not None:
        written = xp.empty(weight.shape, weight.dtype)
        cudnn_conv.run('wgrad', image, written, output, *_geometry(layer))
    if dx is not None:
        target = dx if dx.flags.c_contiguous else xp.empty(dx.shape, dx.dtype)
        if layer.transposed:
            cudnn_conv.run('fprop', dy, weight, target, *_geometry(layer))
        else:
            cudnn_conv.run('dgrad', target, weight, dy, *_geometry(layer))
    if written is not None:
        weight_grad += written.reshape(weight_grad.shape)
    if target is not None and target is not dx:
        dx[...] = target
