"""Pooling and SPP (layers.py), with the host's passes (host.py) and the CUDA kernels
(gpu.py, cuda/pooling.cu); py-faster-rcnn's ROIPooling (roi_pooling.py), a max pooling over
regions; SegNet's Upsample (upsample.py), which undoes a max pooling by the indices of its
mask top."""
