"""Layers that move values without computing on them: Split, Concat, Slice, Flatten,
Reshape, Tile, Crop, Silence and Parameter (layers.py, with canonical_axis, which every layer
with an axis parameter reads); BatchReindex and Filter, which pick items of the batch
(rows.py); SSD's Permute (permute.py), ShuffleNet's ShuffleChannel (shuffle_channel.py), the
YOLO ports' Reorg (reorg.py) and caffe_ocr's Transpose and Reverse (transpose.py)."""
