"""The MobileNet forks' depthwise convolutions: Convolution with one filter per channel
(group = num_output = channels), under the forks' own type names. Their blobs are
Convolution's, (C, 1, *kernel) and (C,), so their caffemodels load as they are."""
from ... import caffe_pb2
from ...layer import register
from ..shape.layers import canonical_axis
from .layers import ConvolutionLayer


class _DepthwiseBase(ConvolutionLayer):
    """Sets up as a Convolution whose convolution_param says group = num_output = channels,
    keeping the layer's own LayerParameter as the prototxt gave it."""

    def depthwise_settings(self, cp, channels):
        """Check or fill in ``cp``, a copy of the convolution_param, for ``channels``."""
        raise NotImplementedError

    def setup(self, bottom, top):
        self.check_bottoms(bottom, minimum=1)
        channels = bottom[0].shape[canonical_axis(self, bottom[0],
                                                  self.param.convolution_param.axis)]
        given = self.param
        depthwise = caffe_pb2.LayerParameter()
        depthwise.CopyFrom(given)
        self.depthwise_settings(depthwise.convolution_param, channels)
        self.param = depthwise
        try:
            super().setup(bottom, top)
        finally:
            self.param = given


@register('ConvolutionDepthwise')
class ConvolutionDepthwiseLayer(_DepthwiseBase):
    """The sp2823 / farmingyard fork's layer: its output has the input's channels whatever
    num_output and group say (the fork reads neither)."""

    def depthwise_settings(self, cp, channels):
        cp.num_output = cp.group = channels


@register('DepthwiseConvolution')
class DepthwiseConvolutionLayer(_DepthwiseBase):
    """yonghenglh6's layer: a Convolution whose prototxt sets group and num_output to the
    channels (its GPU kernel computes nothing else), which is checked here."""

    def depthwise_settings(self, cp, channels):
        if cp.group != channels or cp.num_output != channels:
            raise self.error('computes one filter per channel: needs group = num_output = '
                             'channels (%d), got group %d and num_output %d'
                             % (channels, cp.group, cp.num_output))
