"""Layers that move values without computing on them: Split, Concat, Slice, Flatten,
Reshape, Tile, Crop, Silence, BatchReindex, Filter, Parameter (layers.py); SSD's Permute
(permute.py) and ShuffleNet's ShuffleChannel (shuffle_channel.py); canonical_axis, which
every layer with an axis parameter reads."""
