"""NVCaffe's BatchNorm with its own scale and bias (NVIDIA/caffe 0.16 and later), built for
a BatchNorm whose batch_norm_param says scale_bias, or gives a scale or bias filler, as
NVCaffe decides it (syncbn_policy.nvcaffe_form). docs/fork-layers.md has its rules:

* blobs [mean (C,), var (C,), 1 (1,), scale (C,), bias (C,)]: the running statistics as
  they are (blob 2 is NVCaffe's constant "variance correction", which nothing reads), then
  y = scale * x_hat + bias;
* the phase decides, whatever use_global_stats says: TRAIN normalizes with the batch's
  mean and biased variance, TEST with the running ones; eps is at least 1e-5;
* the running statistics are NVCaffe's average (array.FirstCopyAverage) of the engine the
  layer names: cuDNN's (DEFAULT, CUDNN) or NVCaffe's own (CAFFE);
* its statistics are never learned and its scale and bias always are, with lr_mult and
  decay_mult 1, whatever the prototxt's ParamSpecs say, as NVCaffe sets them;
* TRAIN's backward is NVCaffe's, through the batch statistics; TEST's is the true
  gradient of the TEST forward (NVCaffe's reads what no TEST forward wrote).
"""
from ... import caffe_pb2
from ...layer import TEST, register_variant
from ...syncbn_policy import norm_eps, nvcaffe_form
from .array import FirstCopyAverage
from .batch_norm import BN
from .chain import Chain


@register_variant('BatchNorm', nvcaffe_form)
class NVCaffeBatchNorm(BN):
    """NVCaffe's BatchNorm with scale_bias (the module docstring): BN's passes over blobs in
    NVCaffe's order."""

    STATISTICS, SLOPE, BIAS = 0, 3, 4
    frozen = affine_frozen = False

    def setup(self, bottom, top):
        self.setup_channels(bottom, top)
        p = self.param.batch_norm_param
        self.eps = norm_eps(self.param)
        self.statistics = FirstCopyAverage.of_engine(self, self.STATISTICS,
                                                     p.moving_average_fraction, p.engine)
        channels = (self.channels,)
        one = caffe_pb2.FillerParameter(type='constant', value=1)
        self.blobs = [self.make_blob(channels), self.make_blob(channels),
                      self.make_blob((1,), one),
                      self.make_blob(channels, p.scale_filler if p.HasField('scale_filler')
                                     else one),
                      self.make_blob(channels, p.bias_filler)]
        self.param_propagate_down = [False] * 3 + [True] * 2
        self.use_running_stats = self.phase == TEST

    def fixed_param_mults(self, index):
        return (0.0, 0.0) if index < self.SLOPE else (1.0, 1.0)

    def new_chain(self):
        return Chain(affine_owner=self, beta_index=self.BIAS, gamma_index=self.SLOPE)

    def uses_batch_formula(self):
        return not self.use_running_stats

    def backward_reads_x_hat(self):
        return not self.use_running_stats or self.wants_param_gradient(self.SLOPE)

    def batch_gradient_sums(self, sum_dy, sum_dy_x_hat):
        return None if self.use_running_stats else (sum_dy, sum_dy_x_hat)
