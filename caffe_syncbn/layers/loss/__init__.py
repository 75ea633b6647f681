"""Loss layers: SoftmaxWithLoss and the other *Loss layers of Caffe (layers.py, with the
CUDA softmax loss in gpu.py, cuda/loss.cu), Fast R-CNN's SmoothL1Loss (smooth_l1.py),
SegNet's class-weighted SoftmaxWithLoss (class_weighting.py), caffe_ocr's WarpCTCLoss with
its CTCGreedyDecoder, the decoder whose second form is the CTC nets' accuracy (ctc.py), and
Accuracy (accuracy.py), which reads labels as the losses do and which Caffe's catalogue
lists with them, with DeepLab's SegAccuracy (seg_accuracy.py) beside it. SSD's MultiBoxLoss
is in the detection family."""
