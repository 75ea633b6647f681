"""InnerProduct, and Embed, which is an InnerProduct whose input is one-hot indices: a
row lookup of the same weight matrix."""
