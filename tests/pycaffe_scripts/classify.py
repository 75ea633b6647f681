"""Classify images as pycaffe's classification example does: load_image, a Transformer, a
forward pass; then caffe.Classifier with oversampling and with the centre crop.

usage: classify.py deploy.prototxt weights.caffemodel WORK (WORK holds image0..2.png)
"""
import caffe_syncbn
caffe_syncbn.install_as_caffe()

import sys  # noqa: E402

import numpy as np  # noqa: E402

import caffe  # noqa: E402

model_def, model_weights, work = sys.argv[1:4]
caffe.set_mode_cpu()
net = caffe.Net(model_def, model_weights, caffe.TEST)

mu = np.array([104.0, 117.0, 123.0])          # BGR mean pixel
transformer = caffe.io.Transformer({'data': net.blobs['data'].data.shape})
transformer.set_transpose('data', (2, 0, 1))   # channels first
transformer.set_mean('data', mu)
transformer.set_raw_scale('data', 255)         # [0, 1] to [0, 255]
transformer.set_channel_swap('data', (2, 1, 0))  # RGB to BGR

net.blobs['data'].reshape(3, 3, 32, 32)
images = [caffe.io.load_image('%s/image%d.png' % (work, i)) for i in range(3)]
for i, image in enumerate(images):
    net.blobs['data'].data[i, ...] = transformer.preprocess('data', image)
output = net.forward()
output_prob = output['prob']
print('predicted class is:', output_prob[0].argmax())
np.save(work + '/inputs.npy', net.blobs['data'].data)
np.save(work + '/probs.npy', output_prob)

classifier = caffe.Classifier(model_def, model_weights, image_dims=(36, 36), mean=mu,
                              raw_scale=255, channel_swap=(2, 1, 0))
np.save(work + '/oversampled.npy', classifier.predict(images))
np.save(work + '/center.npy', classifier.predict(images, oversample=False))
