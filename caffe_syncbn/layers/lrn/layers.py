"""Local response normalization, across channels or within each channel.

Both regions compute ``y = x * scale^-beta`` with ``scale = k + alpha/m * (window sum of
x^2)``, where m is the window's cell count (local_size, or local_size^2 within a channel,
where k is 1 as in Caffe). The passes are an engine's: array code (array.py), the host's
bands (host.py) or the CUDA kernels (gpu.py).
"""
import numpy as np

from ... import caffe_pb2
from ...layer import Layer, register
from . import array, gpu, host


@register('LRN')
class LRNLayer(Layer):

    def setup(self, bottom, top):
        self.check_bottoms(bottom, exact=1)
        self.check_tops(top, exact=1)
        lp = self.param.lrn_param
        self.size = lp.local_size
        if self.size < 1 or self.size % 2 == 0:
            raise self.error('local_size must be odd and positive, got %d' % self.size)
        self.alpha, self.beta = lp.alpha, lp.beta
        self.across = lp.norm_region == caffe_pb2.LRNParameter.ACROSS_CHANNELS
        self.k = lp.k if self.across else 1.0
        self.cells = self.size if self.across else self.size ** 2
        #: k + alpha/m * window sum of x^2, kept from the forward for the backward
        self.scale = None
        # the engine, chosen once: ACROSS_CHANNELS runs on the CUDA kernels, or on the
        # host's banded passes over numpy; WITHIN_CHANNEL runs as array code
        if self.across and self.cuda_kernels:
            self.engine = gpu
        elif self.across and self.xp is np:
            self.engine = host
        else:
            self.engine = array

    def reshape(self, bottom, top):
        if bottom[0].num_axes != 4:
            raise self.error('expects a 4-axis (N, C, H, W) bottom, got shape %s'
                             % (bottom[0].shape,))
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        self.engine.forward(self, bottom, top)

    def backward(self, top, propagate_down, bottom):
        self.engine.backward(self, top, propagate_down, bottom)
