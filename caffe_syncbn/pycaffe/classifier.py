"""pycaffe's Classifier: a Net that predicts class probabilities of H x W x K images."""
import numpy as np

from ..layer import TEST
from ..net import Net
from . import io as caffe_io


def make_transformer(net, mean=None, input_scale=None, raw_scale=None, channel_swap=None):
    """A Transformer for the net's first input: H x W x K images, and the given options."""
    name = net.inputs[0]
    transformer = caffe_io.Transformer({name: net.blobs[name].shape})
    transformer.set_transpose(name, (2, 0, 1))
    if mean is not None:
        transformer.set_mean(name, mean)
    if input_scale is not None:
        transformer.set_input_scale(name, input_scale)
    if raw_scale is not None:
        transformer.set_raw_scale(name, raw_scale)
    if channel_swap is not None:
        transformer.set_channel_swap(name, channel_swap)
    return transformer


class Classifier(Net):
    """``Classifier(model_file, pretrained_file, image_dims=None, mean=None, input_scale=None,
    raw_scale=None, channel_swap=None)``: a TEST-phase Net whose ``predict`` resizes images
    to ``image_dims`` (default: the net's input size), crops them to the net's input size
    and runs them through ``transformer`` (see caffe.io.Transformer for the options)."""

    def __init__(self, model_file, pretrained_file, image_dims=None, mean=None, input_scale=None,
                 raw_scale=None, channel_swap=None):
        super().__init__(model_file, TEST, weights=pretrained_file)
        self.transformer = make_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.crop_dims = np.array(self.blobs[self.inputs[0]].shape[2:])
        self.image_dims = self.crop_dims if image_dims is None else image_dims

    def predict(self, inputs, oversample=True):
        """(N x classes) probabilities of N H x W x K images: averaged over the 10 crops of
        caffe.io.oversample (corners, centre, mirrored), or of the centre crop alone."""
        name = self.inputs[0]
        resized = np.array([caffe_io.resize_image(im, self.image_dims) for im in inputs], np.float32)
        if oversample:
            crops = caffe_io.oversample(resized, self.crop_dims)
        else:
            crops = caffe_io.center_crop(resized, self.crop_dims)
        batch = np.array([self.transformer.preprocess(name, crop) for crop in crops])
        predictions = self.forward_all(**{name: batch})[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape((len(predictions) // 10, 10, -1)).mean(1)
        return predictions
