"""Pooling and SPP (layers.py), with the host's passes (host.py) and the CUDA kernels
(gpu.py, cuda/pooling.cu); py-faster-rcnn's ROIPooling (roi_pooling.py), a max pooling over
regions, and R-FCN's PSROIPooling (psroi_pooling.py), an average over the bins of regions,
each bin from its own channel; SegNet's Upsample (upsample.py), which undoes a max pooling by
the indices of its mask top."""
