"""Data layers: Input, DummyData, HDF5Data and HDF5Output (layers.py); Data, ImageData and
MemoryData (image_data.py); the segmentation forks' SegData and DeepLab's ImageSegData
(seg_data.py), SegNet's and ENet's DenseImageData (dense_image_data.py); SSD's
AnnotatedData (annotated_data.py). HDF5Output writes rather than reads, and lives here as
Caffe has it beside HDF5Data; DeepLab's MatWrite and MatRead (mat_files.py) with it."""
