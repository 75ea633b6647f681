"""Layers that move values without computing on them: Split, Concat, Slice, Flatten,
Reshape, Tile, Crop, Silence and Parameter (layers.py, with canonical_axis, which every layer
with an axis parameter reads); BatchReindex and Filter, which pick items of the batch
(rows.py); SSD's Permute (permute.py) and ShuffleNet's ShuffleChannel (shuffle_channel.py)."""
