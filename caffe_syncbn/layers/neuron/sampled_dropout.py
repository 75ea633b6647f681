"""Bayesian SegNet's Dropout (SegNet's Caffe, dropout_param sample_weights_test: true):
in TEST it drops and scales as in TRAIN, a new mask every forward, so that repeated
forwards sample the net (Monte Carlo dropout) and their spread measures its uncertainty."""
from ...layer import TRAIN, register_variant
from .layers import DropoutLayer


def samples_in_test(param):
    return param.dropout_param.sample_weights_test


@register_variant('Dropout', samples_in_test)
class SampledDropoutLayer(DropoutLayer):
    """Dropout whose TEST forward is its TRAIN forward (module docstring)."""

    def setup(self, bottom, top):
        super().setup(bottom, top)
        self.phase = TRAIN          # what Dropout decides by: the mask in every phase
