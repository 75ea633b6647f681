"""pycaffe's Detector: a Net that classifies windows cropped from images (R-CNN style),
optionally with context around each window."""
import os

import numpy as np

from ..errors import CaffeError
from ..layer import TEST
from ..net import Net
from . import io as caffe_io
from .classifier import make_transformer


class Detector(Net):
    """``Detector(model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None,
    channel_swap=None, context_pad=None)``: windows are cropped, warped to the net's input
    size and classified. With ``context_pad`` p, the window is enlarged so that a p-pixel
    border of the warped input is context; what falls outside the image is the mean."""

    def __init__(self, model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None,
                 channel_swap=None, context_pad=None):
        super().__init__(model_file, TEST, weights=pretrained_file)
        self.transformer = make_transformer(self, mean, input_scale, raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows):
        """[{'window', 'prediction', 'filename'}] for each window (ymin, xmin, ymax, xmax) of
        each (image file name, windows) pair."""
        images_windows = [(name, list(windows)) for name, windows in images_windows]
        crops = []
        for filename, windows in images_windows:
            image = caffe_io.load_image(filename)
            crops += [self.crop(image, window) for window in windows]
        if not crops:
            return []
        name = self.inputs[0]
        batch = np.array([self.transformer.preprocess(name, crop) for crop in crops])
        predictions = iter(self.forward_all(**{name: batch})[self.outputs[0]])
        return [{'window': window, 'prediction': next(predictions), 'filename': filename}
                for filename, windows in images_windows for window in windows]

    def detect_selective_search(self, image_fnames):
        """detect_windows over Selective Search proposals (needs the external
        selective_search_ijcv_with_python module and MATLAB)."""
        try:
            import selective_search_ijcv_with_python as selective_search
        except ImportError:
            raise CaffeError('detect_selective_search needs the selective_search_ijcv_with_python '
                             'module on sys.path') from None
        image_fnames = [os.path.abspath(name) for name in image_fnames]
        windows = selective_search.get_windows(image_fnames, cmd='selective_search_rcnn')
        return self.detect_windows(zip(image_fnames, windows))

    def crop(self, im, window):
        """The window (ymin, xmin, ymax, xmax) of an H x W x K image, with context if configured."""
        if not self.context_pad:
            return im[window[0]:window[2], window[1]:window[3]]
        crop_size = self.blobs[self.inputs[0]].width          # a square input, as in R-CNN
        scale = crop_size / (crop_size - 2.0 * self.context_pad)
        box = np.asarray(window, np.float64)
        half_h, half_w = (box[2] - box[0] + 1) / 2.0, (box[3] - box[1] + 1) / 2.0
        center = np.array([box[0] + half_h, box[1] + half_w] * 2)
        box = np.round(center + scale * np.array([-half_h, -half_w, half_h, half_w]))
        scale_h = crop_size / (box[2] - box[0] + 1)
        scale_w = crop_size / (box[3] - box[1] + 1)
        pad_y = int(round(max(0.0, -box[0]) * scale_h))        # rows of the input outside the image
        pad_x = int(round(max(0.0, -box[1]) * scale_w))
        im_h, im_w = im.shape[:2]
        box = np.clip(box, 0.0, [im_h, im_w, im_h, im_w])
        clip_h, clip_w = box[2] - box[0] + 1, box[3] - box[1] + 1
        if clip_h <= 0 or clip_w <= 0:
            raise CaffeError('Detector.crop: window %s lies outside the %dx%d image'
                             % (list(window), im_h, im_w))
        crop_h = min(int(round(clip_h * scale_h)), crop_size - pad_y)
        crop_w = min(int(round(clip_w * scale_w)), crop_size - pad_x)
        context = im[int(box[0]):int(box[2]), int(box[1]):int(box[3])]
        crop = np.ones(self.crop_dims, np.float32) * self.crop_mean
        crop[pad_y:pad_y + crop_h, pad_x:pad_x + crop_w] = caffe_io.resize_image(context, (crop_h, crop_w))
        return crop

    def configure_crop(self, context_pad):
        """Set the crop size (the net's input, as H x W x K) and the context padding; with
        padding, the fill value is the transformer's mean taken back to image space."""
        name = self.inputs[0]
        to_image = np.argsort(self.transformer.transpose[name])
        self.crop_dims = np.array(self.blobs[name].shape[1:])[to_image]
        self.context_pad = context_pad
        if not context_pad:
            return
        mean = self.transformer.mean.get(name)
        if mean is None:
            self.crop_mean = np.zeros(self.crop_dims, np.float32)
            return
        crop_mean = np.array(mean, np.float64).transpose(to_image)
        channel_swap = self.transformer.channel_swap.get(name)
        if channel_swap is not None:
            crop_mean = crop_mean[:, :, np.argsort(channel_swap)]
        raw_scale = self.transformer.raw_scale.get(name)
        if raw_scale is not None:
            crop_mean /= raw_scale
        self.crop_mean = crop_mean
