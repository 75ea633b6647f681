"""What pycaffe scripts use besides the Net: ``caffe`` (the module ``install_as_caffe()``
puts in place of pycaffe's), ``io``, ``draw``, ``coord_map``, ``Classifier``, ``Detector``."""
