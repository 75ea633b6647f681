"""A net's weights in and out of files: the batch norms a file holds in another form fitted
to the net's (norm_forms.py), copying by layer name as Caffe does (copy.py), and writing as
Caffe writes (save.py). It works on any object with a Net's ``layers``, so the Net uses it
without this floor knowing the Net."""
